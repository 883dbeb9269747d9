"""bf16 accuracy: each engine's bf16 logprob error against the fp32 reference on one checkpoint.

* reference: transformers in float32 (eager attention and experts) greedily generates ``--new-tokens``
  (128) tokens after each of ``--prompts`` (16) random prompts of ``--prompt-len`` (32) token ids
  (seed 0); its log-softmax at those positions is the fp32 reference;
* every engine scores the same sequences (prompt + the fp32 tokens), teacher-forced, in float32 and in
  bfloat16: jaxmoe ``LLM(ckpt, dtype=...).generate(seqs, SamplingParams(max_tokens=0,
  prompt_logprobs=0))``; transformers one forward pass over each sequence (sdpa attention; log-softmax
  of its logits in float32); vLLM (with ``--vllm-python``, default /tmp/vllm-venv/bin/python when it
  exists) ``prompt_logprobs=0``; ``jaxmoe-pairs``: jaxmoe with bfloat16 experts stored in pairs of rows
  for AVX512-BF16's dot (the layout of a CPU that has it, widened where it has not: the same rounding);
* error per generated position = |logprob_engine - logprob_reference| of the reference token; the
  table gives its mean and max over all prompts x positions, per engine and dtype (an engine's fp32
  row is its distance from transformers' fp32: the floor of the comparison).

Checkpoints (random Mixtral weights written by transformers, bf16 on disk, as bench/startup.py's):
``--model small`` (hidden 128, 4 layers, 8 experts top-2, expert width 256, vocab 512) or
``--model bench-107m`` (the checkpoint of bench/vs_vllm.py), or ``--ckpt DIR`` (any Mixtral-family
HF directory).

    python bench/bf16_accuracy.py --model small
    python bench/bf16_accuracy.py --model bench-107m --ckpt-dir /tmp/jaxmoe-bench-107m

Imports here are the standard library only: vLLM's interpreter runs this file as its worker.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHAPES = {
    "small": dict(hidden_size=128, intermediate_size=256, vocab_size=512, num_hidden_layers=4),
    "bench-107m": dict(hidden_size=512, intermediate_size=1024, vocab_size=1024, num_hidden_layers=8),
}
DTYPES = ("float32", "bfloat16")


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


# ---------------------------------------------------------------------------------------------- workers
# Each takes the sequences and the prompt length and returns, per dtype, per sequence, the logprob of
# every token after the prompt given the tokens before it.


def worker_reference(args) -> dict:
    """transformers fp32 greedy tokens (eager attention and experts) and their logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    x = torch.tensor(prompts(args.prompts, args.prompt_len, args.vocab), dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens
        )
    seqs = out.tolist()
    return {"seqs": seqs, "float32": _torch_scores(model, seqs, args.prompt_len)}


def _torch_scores(model, seqs: list[list[int]], prompt_len: int) -> list[list[float]]:
    import torch

    x = torch.tensor(seqs, dtype=torch.long)
    with torch.inference_mode():
        logits = model(x).logits.float()
    logp = torch.log_softmax(logits[:, prompt_len - 1 : -1], dim=-1)
    return torch.gather(logp, -1, x[:, prompt_len:, None])[..., 0].tolist()


def worker_transformers(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    seqs = json.loads(pathlib.Path(args.seqs).read_text())
    out = {}
    for dtype in DTYPES:
        model = AutoModelForCausalLM.from_pretrained(
            args.ckpt, dtype=getattr(torch, dtype), attn_implementation="sdpa"
        ).eval()
        out[dtype] = _torch_scores(model, seqs, args.prompt_len)
    return out


def worker_jaxmoe(args, pairs: bool = False) -> dict:
    sys.path.insert(0, str(ROOT))
    from jaxmoe import LLM, SamplingParams

    if pairs:  # the AVX512-BF16 layout and rounding (widened in the kernel where the CPU lacks the instruction)
        from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel

        cpu_kernel.has_bf16_dot = lambda: True

    seqs = json.loads(pathlib.Path(args.seqs).read_text())
    out = {}
    for dtype in DTYPES:
        llm = LLM(args.ckpt, dtype=dtype)
        res = llm.generate(seqs, SamplingParams(max_tokens=0, prompt_logprobs=0))
        out[dtype] = [[lp.logprob for lp in r.prompt_logprobs[args.prompt_len :]] for r in res]
        del llm
    return out


def worker_vllm(args) -> dict:
    from vllm import LLM, SamplingParams

    seqs = json.loads(pathlib.Path(args.seqs).read_text())
    out = {}
    for dtype in DTYPES:
        llm = LLM(
            str(args.ckpt),  # vLLM 0.32 calls .lower() on the path
            dtype=dtype,
            skip_tokenizer_init=True,
            enable_prefix_caching=False,
            max_num_seqs=16,
            max_model_len=512,
            seed=0,
        )
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
        res = llm.generate([{"prompt_token_ids": s} for s in seqs], sp, use_tqdm=False)
        out[dtype] = [
            [lp[tok].logprob for lp, tok in zip(r.prompt_logprobs[args.prompt_len :], s[args.prompt_len :])]
            for r, s in zip(res, seqs)
        ]
        del llm
    return out


WORKERS = {
    "reference": worker_reference,
    "jaxmoe": worker_jaxmoe,
    "jaxmoe-pairs": lambda args: worker_jaxmoe(args, pairs=True),
    "transformers": worker_transformers,
    "vllm": worker_vllm,
}

# ---------------------------------------------------------------------------------------------- driver


def run_worker(engine: str, args, python: str) -> dict:
    cmd = [python, str(pathlib.Path(__file__).resolve()), "--worker", engine, "--ckpt", str(args.ckpt)]
    cmd += ["--seqs", str(args.seqs), "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len)]
    cmd += ["--new-tokens", str(args.new_tokens), "--vocab", str(args.vocab), "--threads", str(args.threads)]
    env = dict(os.environ)
    if engine == "vllm":
        cores = sorted(os.sched_getaffinity(0))
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}-{cores[-1]}", VLLM_CPU_KVCACHE_SPACE="1")
    sys.path.insert(0, str(ROOT))
    from bench.vs_vllm import worker_result

    return worker_result(cmd, env, ROOT, engine, args.timeout)


def errors(scores: list[list[float]], reference: list[list[float]]) -> tuple[float, float]:
    """Mean and max |score - reference| over every row and position."""
    diffs = [abs(a - b) for row, ref in zip(scores, reference) for a, b in zip(row, ref, strict=True)]
    return sum(diffs) / len(diffs), max(diffs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", choices=sorted(WORKERS))
    p.add_argument("--model", choices=sorted(SHAPES), default="small")
    p.add_argument("--ckpt-dir", type=pathlib.Path, default=None, help="where --model's checkpoint is (made if absent)")
    p.add_argument("--ckpt", type=pathlib.Path, default=None, help="an existing checkpoint (instead of --model)")
    p.add_argument("--engines", default="jaxmoe,transformers,vllm")
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--vocab", type=int, default=0)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--seqs", default=None)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", type=pathlib.Path, default=None, help="also write every logprob there")
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(WORKERS[args.worker](args)), flush=True)
        return 0

    if args.ckpt is None:
        args.ckpt = args.ckpt_dir or pathlib.Path(f"/tmp/jaxmoe-bf16-{args.model}")
        if args.model == "bench-107m" and args.ckpt_dir is None:
            args.ckpt = pathlib.Path("/tmp/jaxmoe-bench-107m")
        sys.path.insert(0, str(ROOT / "bench"))
        import startup

        startup.write_checkpoint(args.ckpt, **SHAPES[args.model])
    args.vocab = args.vocab or json.loads((args.ckpt / "config.json").read_text())["vocab_size"]
    engines = [e for e in args.engines.split(",") if e]
    if "vllm" in engines and not os.path.exists(args.vllm_python):
        print(f"  vllm: {args.vllm_python} not found, left out", file=sys.stderr)
        engines.remove("vllm")

    t0, loads = time.time(), [os.getloadavg()[0]]
    ref = run_worker("reference", args, sys.executable)
    seqs_file = pathlib.Path(f"/tmp/bf16-accuracy-seqs-{os.getpid()}.json")
    seqs_file.write_text(json.dumps(ref["seqs"]))
    args.seqs = seqs_file
    results = {}
    for engine in engines:
        results[engine] = run_worker(engine, args, args.vllm_python if engine == "vllm" else sys.executable)
        loads.append(os.getloadavg()[0])
    seqs_file.unlink()

    print(
        f"# {platform.node()} {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M %Z')}, checkpoint {args.ckpt}, "
        f"{args.prompts} prompts x {args.new_tokens} tokens teacher-forced on transformers' fp32 greedy tokens, "
        f"load {min(loads):.1f}-{max(loads):.1f}, {time.time() - t0:.0f} s"
    )
    print("| engine | fp32 mean / max | bf16 mean / max |")
    print("|---|---|---|")
    for engine, res in results.items():
        cells = [errors(res[d], ref["float32"]) for d in DTYPES]
        print(f"| {engine} | " + " | ".join(f"{m:.2e} / {x:.2e}" for m, x in cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"reference": ref, "engines": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
