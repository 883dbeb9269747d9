"""Decode speed of bf16 against int8 / fp8 routed-expert weights (``LLM(..., quantization=...)``) at batch
1 and 16, greedy, on the same model in one process (each form measured in turn, best of ``--repeats``).

    python bench/quantized_decode.py                       # the demo model
    python bench/quantized_decode.py --model /tmp/mixtral  # any checkpoint (bench/big_checkpoint.py --keep)
    python bench/quantized_decode.py --forms none,int8,none,int8  # alternating: the first row is the base
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/quantized_decode.py --mesh meshes/cpu-8.yaml

int8 weights go through the CPU expert kernel's int8 path (read as int8, scaled in the tile); fp8 ones
through ``bucketed_loop``, one expert dequantized at a time; with ``--mesh`` on the disaggregated executor
(the expert sub-mesh holds the quantized replica slots). Prints one JSON line per form.
"""

from __future__ import annotations

import argparse
import json
import time


def decode_rate(llm, batch: int, tokens: int, repeats: int) -> float:
    from jaxmoe import SamplingParams

    prompts = [[(5 * i + b) % 200 + 3 for i in range(16)] for b in range(batch)]
    greedy = lambda n: SamplingParams(max_tokens=n, ignore_eos=True)  # noqa: E731
    llm.generate(prompts, greedy(4))  # compile
    full, first = [], []  # the best time of each over the repeats: a slow 1-token call in one repeat
    for _ in range(repeats):  # must not make that repeat's decode look fast (a load spike did: 735 tok/s)
        t0 = time.perf_counter()
        llm.generate(prompts, greedy(tokens + 1))
        full.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        llm.generate(prompts, greedy(1))
        first.append(time.perf_counter() - t0)
    return batch * tokens / (min(full) - min(first))  # decode steps only


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--forms", default="none,int8,fp8")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", default="1,16", help="batch sizes, comma-separated")
    p.add_argument("--mesh", default=None, help="a mesh file: the disaggregated executor (default: monolithic)")
    args = p.parse_args()

    import jax

    from jaxmoe import LLM
    from jaxmoe.quantization import ROUTED

    base = None
    for form in args.forms.split(","):
        q = None if form == "none" else form
        llm = LLM(
            args.model, dtype="bfloat16", quantization=q, mesh=args.mesh, num_blocks=256, block_size=16, max_num_seqs=16
        )
        if args.mesh is None:
            groups = llm.executor.stacked["groups"]
        else:  # the replica slots [S, ...] of every MoE layer on the expert sub-mesh
            groups = llm.executor.params["layers"]
        nbytes = sum(a.nbytes for g in groups if "moe" in g for k in ROUTED for a in jax.tree.leaves(g["moe"][k]))
        row = {"model": args.model, "mesh": args.mesh, "weights": form if q else "bf16", "expert_bytes": nbytes}
        for batch in map(int, args.batches.split(",")):
            row[f"decode_tok_s_b{batch}"] = round(decode_rate(llm, batch, args.tokens, args.repeats), 1)
        if base is None:
            base = row
        row["vs_bf16"] = {
            k: round(row[k] / base[k], 3) for k in row if k.startswith("decode_tok_s") or k == "expert_bytes"
        }
        print(json.dumps(row), flush=True)
        del llm


if __name__ == "__main__":
    main()
