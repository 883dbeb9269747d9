"""The monolithic executor's three forms of one decode (or prefill) forward, same process, alternating:

* ``fused``: the whole model as one program (the ``lax.scan`` over each layer group; ``LLM.generate``,
  ``--no-layer-preemption``);
* ``split``: ``embed``, one ``layers`` call per layer group (a ``fori_loop`` with a traced count), ``head``
  (a serving loop's steps that do not pause, ``split_step``);
* ``per_layer``: one ``layers`` call per layer with a pause point after each that does nothing (QLLM's
  pausable step, ``pause_every=1``).

Every round runs each form once, in turn; medians of wall and process CPU time (every thread) per
forward. The logits' argmax must agree across the forms (checked before timing); ``--unroll U,...``
also times the fused program traced with ``lax.scan(..., unroll=U)`` and checks its logits are equal.

    python bench/startup.py ...   # or: write_checkpoint(path, **SHAPES["bench-107m"], num_hidden_layers=16)
    python bench/fused_scan.py /tmp/perf-107m-16l --dtype float32 --batch 16 [--tokens 1] [--rounds 20]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.checkpoint import load_params
from jaxmoe.config import load_config
from jaxmoe.models.attention import AttentionBatch
from jaxmoe.models.routing import for_call
from jaxmoe.runtime import monolithic
from jaxmoe.runtime.monolithic import MonolithicExecutor

BLOCK, BLOCKS_PER_ROW = 16, 16  # 256 KV slots per row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="checkpoint directory")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1, help="tokens per row (1: decode at position 128)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--expert-impl", default="auto")
    ap.add_argument("--unroll", default="", help="also the fused program with lax.scan unroll=U (comma list)")
    args = ap.parse_args()

    cfg = load_config(args.model)
    dtype = jnp.dtype(args.dtype)
    params = jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                          load_params(args.model, cfg))  # fmt: skip
    B, T = args.batch, args.tokens
    ex = MonolithicExecutor(cfg, params, B * BLOCKS_PER_ROW * BLOCK, BLOCK, expert_impl=args.expert_impl)
    start = 128 if T == 1 else 0
    tokens = np.full((B, T), 5, np.int32)
    positions = np.broadcast_to(start + np.arange(T, dtype=np.int32), (B, T)).copy()
    tables = np.arange(B * BLOCKS_PER_ROW, dtype=np.int32).reshape(B, BLOCKS_PER_ROW)
    slots = np.take_along_axis(tables, positions // BLOCK, 1) * BLOCK + positions % BLOCK
    batch, index = AttentionBatch(positions, slots, tables), np.full(B, T - 1, np.int32)

    def form(split: bool, per_layer: bool):
        ex.split_step = split
        return ex.forward(tokens, batch, index, between_layers=(lambda n: None) if per_layer else None)

    forms = {
        "fused": functools.partial(form, False, False),
        "split": functools.partial(form, True, False),
        "per_layer": functools.partial(form, False, True),
    }
    reference = np.asarray(forms["fused"]())
    for name, run in forms.items():
        assert np.array_equal(np.argmax(np.asarray(run()), -1), np.argmax(reference, -1)), name
    for u in [int(u) for u in args.unroll.split(",") if u]:
        forms[f"fused_unroll{u}"] = run = _unrolled(ex, cfg, u, tokens, batch, index)
        assert np.array_equal(np.asarray(run()), reference), f"unroll={u} changed the logits"

    wall, cpu = ({k: [] for k in forms} for _ in range(2))
    for _ in range(args.rounds):
        for name, run in forms.items():
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(run())
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    median = lambda d: {k: round(1e3 * float(np.median(v)), 2) for k, v in d.items()}  # noqa: E731
    print(json.dumps({
        "model": args.model, "layers": cfg.num_layers, "dtype": args.dtype, "batch": B, "tokens": T,
        "expert_impl": ex.expert_impl, "wall_ms": median(wall), "cpu_ms": median(cpu),
        "load": open("/proc/loadavg").read().split()[:3],
    }))  # fmt: skip


def _unrolled(ex: MonolithicExecutor, cfg, unroll: int, tokens, batch, index):
    """The fused step program traced with ``lax.scan(..., unroll=unroll)`` (traced at the first call)."""
    program = monolithic.step_program(cfg, ex.block_size, ex.expert_impl, ex.routing)
    traced = False

    def run():
        nonlocal traced
        tk, b, ix = ex._args(tokens, batch, index)
        state = for_call(ex.routing_state, tk.shape[1])
        scan = jax.lax.scan
        if not traced:
            jax.lax.scan = functools.partial(scan, unroll=unroll)
        try:
            logits, ex.cache = program(ex.stacked, tk, b, ex.cache, ix, state)
        finally:
            jax.lax.scan, traced = scan, True
        return logits

    return run


if __name__ == "__main__":
    main()
