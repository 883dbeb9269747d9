"""A multi-GB checkpoint end to end: generate a random Mixtral-shaped bf16 checkpoint (sharded safetensors,
tensor by tensor, ``jaxmoe.checkpoint.synthetic``), then in a fresh process load it and serve it:

* ``load_params``: wall time and peak resident memory (VmHWM growth over the process before the load)
  against the checkpoint's bytes, with the loader's progress bar on stderr;
* ``LLM(path)``: the whole start-up (load + the executor's layer stacking + KV cache), its peak RSS;
* TTFT of a 128-token prompt, and decode tokens/s at batch 1 and 16 (greedy, 32 tokens).

    python bench/big_checkpoint.py --out /tmp/mixtral-3b            # about 3.0 B parameters, 6 GB
    python bench/big_checkpoint.py --out /tmp/mixtral-1b --layers 3  # a smaller one, same shapes

Prints one JSON object (and appends it to ``--log`` if given). The checkpoint is kept (``--keep``) or
removed at the end; an existing one with the same config is reused.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

MEASURE = r"""
import json, sys, time
import jax, jax.numpy as jnp

def status(key):  # this program's peak RSS (getrusage's ru_maxrss keeps a forking parent's)
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

path, quantization = sys.argv[1], (sys.argv[2] if sys.argv[2] != "none" else None)
from jaxmoe import LLM, SamplingParams
from jaxmoe.checkpoint import load_params
from jaxmoe.config import load_config

jnp.zeros(4).block_until_ready()
out = {"rss_before_load": status("VmRSS")}
cfg = load_config(path)
t0 = time.perf_counter()
params = load_params(path, cfg, progress=True)
jax.block_until_ready(params)
out["load_params_s"] = round(time.perf_counter() - t0, 2)
out["load_params_peak_rss"] = status("VmHWM") - out["rss_before_load"]
out["param_bytes"] = sum(a.nbytes for a in jax.tree.leaves(params))
del params

t0 = time.perf_counter()
llm = LLM(path, quantization=quantization, num_blocks=512, block_size=16, max_num_seqs=16, max_batch_tokens=512)
out["llm_start_s"] = round(time.perf_counter() - t0, 2)
out["llm_start_peak_rss"] = status("VmHWM") - out["rss_before_load"]
out["rss_serving"] = status("VmRSS") - out["rss_before_load"]

prompt = [(7 * i) % 200 + 3 for i in range(128)]
greedy = lambda n: SamplingParams(max_tokens=n, ignore_eos=True)
llm.generate([prompt], greedy(2))  # compile prefill and decode
ttft = []
for _ in range(3):
    t0 = time.perf_counter()
    llm.generate([prompt], greedy(1))
    ttft.append(time.perf_counter() - t0)
out["ttft_s_128"] = round(min(ttft), 4)
for batch in (1, 16):
    prompts = [[(5 * i + b) % 200 + 3 for i in range(16)] for b in range(batch)]
    llm.generate(prompts, greedy(4))  # compile this batch size
    best = None
    for _ in range(2):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, greedy(33))
        dt = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate(prompts, greedy(1))
        dt -= time.perf_counter() - t0  # decode only: less the prefill and first token
        rate = batch * 32 / dt
        best = rate if best is None else max(best, rate)
    out[f"decode_tok_s_b{batch}"] = round(best, 1)
print(json.dumps(out))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="checkpoint directory (created, or reused if it matches)")
    p.add_argument("--layers", type=int, default=10, help="decoder layers (10: about 3.0 B parameters)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--shard-gb", type=float, default=2.0)
    p.add_argument("--quantization", default="none", choices=["none", "int8", "fp8"])
    p.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    p.add_argument("--log", default=None, help="append the JSON result to this file")
    args = p.parse_args()

    from jaxmoe.checkpoint.synthetic import mixtral_config, num_params, write_random_checkpoint

    hf = mixtral_config(args.hidden, args.intermediate, args.layers, args.experts)
    out = Path(args.out)
    config = out / "config.json"
    t0 = time.perf_counter()
    if config.exists() and json.loads(config.read_text()) == hf:
        nbytes = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
        generate_s = None
    else:
        shutil.rmtree(out, ignore_errors=True)
        nbytes = write_random_checkpoint(out, hf, shard_bytes=int(args.shard_gb * (1 << 30)), progress=True)
        generate_s = round(time.perf_counter() - t0, 1)
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(out), args.quantization], stdout=subprocess.PIPE, text=True, timeout=7200
    )
    if run.returncode:
        return run.returncode
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "params": num_params(hf),
        "checkpoint_bytes": nbytes,
        "shards": len(list(out.glob("*.safetensors"))),
        "generate_s": generate_s,
        "quantization": args.quantization,
        **json.loads(run.stdout.strip().splitlines()[-1]),
    }
    for key in ("load_params_peak_rss", "llm_start_peak_rss", "rss_serving"):
        result[key.replace("rss", "x_ckpt")] = round(result[key] / nbytes, 3)
    print(json.dumps(result))
    if args.log:
        with open(args.log, "a") as f:
            f.write(json.dumps(result) + "\n")
    if not args.keep:
        shutil.rmtree(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
