"""Block-wise FP8 checkpoints (DeepSeek-V3 / Qwen3-FP8 format): an FP8 checkpoint made from a tiny bf16
one serves the same greedy tokens and logprobs as its dequantized bf16 copy (served by jaxmoe and by
transformers); malformed scales and unsupported quantization methods are refused by name."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch

from jaxmoe import LLM, CheckpointError, SamplingParams, load_config, load_params
from jaxmoe.checkpoint.fp8 import dequantize, dequantize_checkpoint, quantize, quantize_checkpoint
from jaxmoe.checkpoint.safetensors_reader import SafetensorsCheckpoint, write_safetensors
from tiny_checkpoints import hf_model

STEPS = 12
# (family, block): the releases' 128 x 128 blocks, and 16 x 16 ones so that the tiny weights span
# several blocks, partial ones at the edges included (moe_intermediate_size 24, hidden 48).
CASES = [
    ("deepseek_v3", (128, 128)),
    ("qwen2_moe", (128, 128)),
    ("deepseek_v2", (16, 16)),
    ("qwen3_moe", (16, 16)),
    ("mixtral", (16, 16)),
]


@pytest.fixture(scope="module")
def fp8_pair(checkpoint_dir, tmp_path_factory):
    """(fp8 checkpoint, its dequantized bf16 copy) per (family, block), made once per module."""
    made = {}

    def get(family, block):
        if (family, block) not in made:
            root = tmp_path_factory.mktemp(f"fp8-{family}-{block[0]}")
            fp8 = quantize_checkpoint(checkpoint_dir(family, dtype="bfloat16"), root / "fp8", block)
            made[family, block] = fp8, dequantize_checkpoint(fp8, root / "bf16")
        return made[family, block]

    return get


def _greedy(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(max_tokens=STEPS, ignore_eos=True, logprobs=0))
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


def test_quantize_dequantize_round_trip_blocks():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 70)).astype(np.float32)
    w[16:32, 48:64] *= 100.0  # one block with a much larger range: its own scale keeps the rest precise
    q, scale = quantize(w, (16, 16))
    assert q.dtype == ml_dtypes.float8_e4m3fn and scale.shape == (3, 5) and scale.dtype == np.float32
    back = dequantize(q, scale, (16, 16), np.float32)
    for i in range(3):
        for j in range(5):
            blk = (slice(16 * i, 16 * i + 16), slice(16 * j, 16 * j + 16))
            expect = q[blk].astype(np.float32) * scale[i, j]
            np.testing.assert_array_equal(back[blk], expect)
            assert np.abs(back[blk] - w[blk]).max() <= 0.07 * np.abs(w[blk]).max()


def test_fp8_checkpoint_is_in_the_release_format(fp8_pair, checkpoint_dir):
    fp8, bf16 = fp8_pair("deepseek_v3", (128, 128))
    config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    }
    ckpt = SafetensorsCheckpoint(fp8)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert ckpt.dtype_name(name) == "F8_E4M3" and ckpt.dtype_name(name + "_scale_inv") == "F32"
    assert ckpt.shape(name + "_scale_inv") == (1, 1)
    assert ckpt.dtype_name("model.layers.1.self_attn.kv_b_proj.weight") == "F8_E4M3"
    source = SafetensorsCheckpoint(checkpoint_dir("deepseek_v3", dtype="bfloat16"))
    for kept in ("model.layers.1.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight"):
        assert ckpt.dtype_name(kept) == source.dtype_name(kept) != "F8_E4M3"  # as they were (the router: float32)
    assert "quantization_config" not in json.loads((bf16 / "config.json").read_text())
    assert SafetensorsCheckpoint(bf16).dtype_name(name) == "BF16"


@pytest.mark.slow
@pytest.mark.parametrize("family,block", CASES, ids=[f"{f}-{b[0]}" for f, b in CASES])
def test_fp8_serves_like_its_dequantized_checkpoint(fp8_pair, family, block):
    fp8, bf16 = fp8_pair(family, block)
    cfg = load_config(fp8)
    for a, b in zip(*(jax_leaves(load_params(p, cfg)) for p in (fp8, bf16))):
        np.testing.assert_array_equal(a, b)  # dequantized on load exactly as the saved copy

    kw = dict(dtype="float32", num_blocks=64, block_size=4, max_num_seqs=4)
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(6, cfg.vocab_size, n))) for n in (9, 5)]
    tokens, logprobs = _greedy(LLM(fp8, **kw), prompts)
    ref_tokens, ref_logprobs = _greedy(LLM(bf16, **kw), prompts)
    assert tokens == ref_tokens
    np.testing.assert_array_equal(logprobs, ref_logprobs)

    hf = hf_model(bf16)
    hf.generation_config.eos_token_id = None
    for prompt, toks, lps in zip(prompts, tokens, logprobs):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=STEPS,
                min_new_tokens=STEPS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        assert out.sequences[0, len(prompt) :].tolist() == toks
        hf_lps = [torch.log_softmax(s[0].double(), -1)[t].item() for s, t in zip(out.scores, toks)]
        np.testing.assert_allclose(lps, hf_lps, atol=2e-4)


def jax_leaves(params):
    import jax

    return [np.asarray(x, np.float32) for x in jax.tree.leaves(params)]


def _edit_scale(path, name, edit):
    f = path / "model.safetensors"
    ckpt = SafetensorsCheckpoint(path)
    tensors = {n: np.array(ckpt.read(n)) for n in ckpt.names()}
    edit(tensors)
    tmp = f.with_suffix(".tmp")
    write_safetensors(tmp, [(n, a.shape, a.dtype) for n, a in tensors.items()], tensors.__getitem__)
    tmp.replace(f)


SCALE = "model.layers.2.mlp.experts.5.up_proj.weight_scale_inv"


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.pop(SCALE), f"scale tensor '{SCALE}' is missing"),
        (lambda t: t.__setitem__(SCALE, np.ones((1, 1), np.float32)), f"scale tensor '{SCALE}' has shape (1, 1)"),
        (lambda t: t[SCALE].__setitem__((1, 0), np.nan), f"scale tensor '{SCALE}' holds non-finite values"),
        (lambda t: t[SCALE].__setitem__((0, 2), np.inf), f"scale tensor '{SCALE}' holds non-finite values"),
    ],
    ids=["missing", "block-shape", "nan", "inf"],
)
def test_malformed_scale_is_refused_by_name(fp8_pair, tmp_path, edit, message):
    fp8, _ = fp8_pair("qwen3_moe", (16, 16))
    path = shutil.copytree(fp8, tmp_path / "bad")
    _edit_scale(path, SCALE, edit)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_params(path, load_config(path))
    with pytest.raises(CheckpointError, match="up_proj.weight_scale_inv"):
        LLM(path, dtype="float32", num_blocks=8, block_size=4)


def test_fp8_tensor_without_quantization_config_is_refused(fp8_pair, tmp_path):
    fp8, _ = fp8_pair("qwen3_moe", (16, 16))
    path = shutil.copytree(fp8, tmp_path / "noconfig")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"is F8_E4M3 but config.json has no fp8 quantization_config"):
        load_params(path, load_config(path))


@pytest.mark.parametrize(
    "qconfig,message",
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported; jaxmoe loads 'fp8'"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size must be two positive integers"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2' is not supported"),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
            "activation_scheme 'static' is not supported",
        ),
    ],
    ids=["awq", "gptq", "bitsandbytes", "per-tensor", "e5m2", "static"],
)
def test_unsupported_quantization_is_refused_in_one_line(checkpoint_dir, tmp_path, qconfig, message):
    path = shutil.copytree(checkpoint_dir("mixtral"), tmp_path / "q")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = qconfig
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message) as e:
        LLM(path, dtype="float32", num_blocks=8, block_size=4)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_sharded_checkpoint_quantizes_shard_by_shard(checkpoint_dir, tmp_path):
    src = checkpoint_dir("mixtral", sharded=True)
    fp8 = quantize_checkpoint(src, tmp_path / "fp8", (16, 16))
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    assert index[name + "_scale_inv"] == index[name]
    assert sorted(set(index.values())) == sorted(p.name for p in src.glob("*.safetensors"))
    assert SafetensorsCheckpoint(fp8).dtype_name("model.layers.0.block_sparse_moe.gate.weight") == "F32"  # a router
    cfg = load_config(fp8)
    plain = jax_leaves(load_params(src, cfg))
    for a, b in zip(jax_leaves(load_params(fp8, cfg)), plain):
        assert np.abs(a - b).max() <= 0.07 * np.abs(b).max()
