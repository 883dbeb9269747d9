"""Serving-time weight quantization (``LLM(..., quantization="int8" | "fp8")``): the quantized forms and
their error, the routed-expert bytes, serving that equals the same model on the dequantized weights (every
expert implementation, with and without quantized attention), and the command-line flags."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.cli import build_parser
from jaxmoe.engine.engine import EngineConfig, LLMEngine
from jaxmoe.assembly import RuntimeConfig, build_executor
from jaxmoe.checkpoint.model import load_model
from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel
from jaxmoe.pallas_kernels.expert_ffn.panels import Panels
from jaxmoe.quantization import (
    Quantized,
    dequantize_params,
    quantize_fp8,
    quantize_int8,
    routed_expert_bytes,
)


@pytest.mark.slow
def test_int8_is_per_output_channel():
    w = jax.random.normal(jax.random.key(0), (3, 40, 24)) * jnp.arange(1, 25)  # columns of different range
    q = quantize_int8(w)
    assert q.q.dtype == jnp.int8 and q.scale.shape == (3, 1, 24) and q.method == "int8"
    assert int(jnp.abs(q.q).max()) == 127
    err = jnp.abs(q.dequantize(jnp.float32) - w).max(axis=-2)
    assert bool(jnp.all(err <= 0.5 * q.scale[:, 0] * 1.0001))  # half a step of that channel's scale


@pytest.mark.slow
def test_fp8_is_per_128_block_with_partial_edges():
    w = jax.random.normal(jax.random.key(1), (2, 200, 136))
    w = w.at[:, 128:, :128].multiply(50.0)  # one block per expert with a much larger range
    q = quantize_fp8(w)
    assert q.q.dtype == jnp.float8_e4m3fn and q.scale.shape == (2, 2, 2) and q.block == (128, 128)
    back = q.dequantize(jnp.float32)
    for i, rows in enumerate((slice(0, 128), slice(128, 200))):
        for j, cols in enumerate((slice(0, 128), slice(128, 136))):
            blk = w[:, rows, cols]
            assert bool(jnp.all(jnp.abs(back[:, rows, cols] - blk).max(axis=(1, 2)) <= 0.07 * jnp.abs(blk).max()))
            np.testing.assert_allclose(q.scale[:, i, j], jnp.abs(blk).max(axis=(1, 2)) / 448.0, rtol=1e-6)
    one = q.at(1)  # one expert's slice keeps its scales
    np.testing.assert_array_equal(one.dequantize(jnp.float32), back[1])


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_expert_weight_bytes_at_most_055_of_bf16(method):
    _, plain, _ = load_model("demo", "bfloat16")
    _, quant, _ = load_model("demo", "bfloat16", method)
    ratio = routed_expert_bytes(quant) / routed_expert_bytes(plain)
    assert ratio <= 0.55, ratio
    layer = next(layer for layer in quant["layers"] if "moe" in layer)
    assert all(isinstance(layer["moe"][k], Quantized) for k in ("w_gate", "w_up", "w_down"))
    assert not isinstance(layer["attn"]["q"], Quantized)  # attention only with quantize_attention


def _generate(engine, prompts, n=10):
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0)) for p in prompts]
    final = engine.run_until_done()
    return [final[i].token_ids for i in ids], [[lp.logprob for lp in final[i].logprobs] for i in ids]


CASES = [
    ("tiny-random", "int8", False, "cpu_kernel"),  # D, F multiples of 64: int8 panels in the CPU kernel
    ("qwen3_moe", "int8", False, "auto"),
    ("qwen3_moe", "fp8", True, "auto"),
    ("deepseek_v3", "int8", True, "bucketed_loop"),
    ("deepseek_v3", "fp8", False, "dense"),
]


@pytest.mark.slow
@pytest.mark.parametrize("family,method,attention,impl", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_quantized_serving_equals_the_dequantized_model(checkpoint_dir, family, method, attention, impl):
    path = family if family == "tiny-random" else checkpoint_dir(family)
    kw = dict(num_blocks=64, block_size=4, max_num_seqs=4, expert_impl=impl)
    llm = LLM(path, dtype="float32", quantization=method, quantize_attention=attention, **kw)
    layer = llm.executor.stacked["groups"][-1]
    assert isinstance(layer["moe"]["w_up"], Quantized)
    if impl == "cpu_kernel" and cpu_kernel.available():
        assert isinstance(layer["moe"]["w_up"].q, Panels)
    assert isinstance(layer["attn"]["o"], Quantized) == attention
    cfg, params, tok = load_model(path, "float32", method, attention)
    ec = EngineConfig(**kw)
    reference = LLMEngine(cfg, build_executor(cfg, dequantize_params(params), RuntimeConfig(engine=ec)), tok, ec)
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(6, cfg.vocab_size, n))) for n in (7, 3)]
    tokens, logprobs = _generate(llm.engine, prompts)
    ref_tokens, ref_logprobs = _generate(reference, prompts)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-4)
    # and close to the unquantized model (tiny random weights: logprobs within the quantization error)
    _, plain_logprobs = _generate(LLM(path, dtype="float32", **kw).engine, [p for p in prompts])
    assert np.abs(np.asarray(logprobs) - np.asarray(plain_logprobs)).mean() < 0.25


def test_quantization_is_refused_for_bad_names(checkpoint_dir):
    path = checkpoint_dir("mixtral")
    with pytest.raises(ValueError, match="quantization must be one of int8, fp8"):
        LLM(path, quantization="int4")
    with pytest.raises(ValueError, match="quantize_attention needs quantization"):
        LLM(path, quantize_attention=True)


def test_cli_flags(capsys):
    parser = build_parser()
    for command in (["generate"], ["serve"], ["eval"]):
        args = parser.parse_args(command + ["--quantization", "fp8", "--quantize-attention"])
        assert args.quantization == "fp8" and args.quantize_attention
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantization", "awq"])
    assert "invalid choice: 'awq'" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_scores_the_quantized_weights(capsys):
    """``jaxmoe eval --quantization``: the held-out perplexity of the int8 model, near the float one
    (on the demo model: within 0.01 % for int8, 0.1 % for fp8 over 8192 tokens, BENCHMARKS.md)."""
    from jaxmoe.cli import main

    results = {}
    for flags in ([], ["--quantization", "int8"]):
        args = ["eval", "--model", "tiny-random", "--max-tokens", "96", "--seq-len", "32", "--json", *flags]
        assert main(args) == 0
        results[flags[-1] if flags else "float"] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["int8"]["quantization"] == "int8" and "quantization" not in results["float"]
    base = results["float"]["perplexity"]
    assert math.isfinite(base) and abs(results["int8"]["perplexity"] / base - 1) < 0.02
