"""Loading a sharded checkpoint keeps the process's peak resident memory near the checkpoint's bytes:
tensors are read from mapped files a leaf at a time and the mapped pages are let go after each leaf,
and ``LLM(path)`` stacks the loaded layers without a second copy of any stacked parameter (measured in
a fresh subprocess: peak RSS growth during ``load_params`` and during the whole ``LLM(path)``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from jaxmoe.checkpoint.synthetic import mixtral_config, num_params, write_random_checkpoint

MARGIN = 24 << 20  # allocator and runtime slack, independent of the checkpoint's size

_MEASURE = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp
    from jaxmoe import LLM
    from jaxmoe.checkpoint import model

    def status(key):  # VmHWM: this program's peak RSS (getrusage's ru_maxrss keeps the forking parent's)
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    loaded, load_params = {}, model.load_params

    def measured_load(*args, **kwargs):  # LLM's own load (with its progress bar), its peak when it returns
        params = jax.block_until_ready(load_params(*args, **kwargs, progress=True))
        loaded.update(load_peak=status("VmHWM"), param_bytes=sum(a.nbytes for a in jax.tree.leaves(params)))
        return params

    model.load_params = measured_load
    jnp.zeros(4, jnp.bfloat16).block_until_ready()
    base = status("VmRSS")
    llm = LLM(sys.argv[1], max_num_seqs=2, num_blocks=8)
    jax.block_until_ready(llm.engine.executor.stacked)
    print(json.dumps({"base": base, "peak": status("VmHWM"), **loaded}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("shard_mb", [16])
def test_sharded_load_peak_rss_below_125x_checkpoint(tmp_path, shard_mb):
    # expert weights dominate, as in real MoE checkpoints (a leaf -- one layer's w_gate -- is 5 % of the bytes)
    hf = mixtral_config(hidden=256, intermediate=1024, layers=6, heads=8, kv_heads=2, vocab=4096)
    ckpt_bytes = write_random_checkpoint(tmp_path / "ckpt", hf, shard_bytes=shard_mb << 20)
    assert ckpt_bytes == 2 * num_params(hf) and ckpt_bytes > 60 << 20
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) >= 3
    # a fixed mmap threshold: glibc's sliding one would keep freed layer arrays in its heap, and the
    # peak would measure the allocator's policy instead of what the load holds
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 << 10)}
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-2000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    assert m["param_bytes"] == ckpt_bytes
    growth = m["load_peak"] - m["base"]
    assert growth <= 1.25 * ckpt_bytes + MARGIN, (growth / ckpt_bytes, m)
    assert "loading weights" in run.stderr  # the progress bar, on stderr
    # stacking the layers for the layer scan holds no stacked parameter beside its per-layer arrays
    # (one routed expert weight stacked over the layers is 0.3x of this checkpoint)
    growth = m["peak"] - m["base"]
    assert growth <= 1.25 * ckpt_bytes + MARGIN, (growth / ckpt_bytes, m)
