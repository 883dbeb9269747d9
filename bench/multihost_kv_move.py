"""The attention side of a live rescale across 2 JAX processes (meshes/cpu-2x4.yaml -> 4a4e): how long
``build_rescaled`` takes (attention parameters and expert replicas moved by ``slot_moves`` collectives,
their programs compiled on first use) and the KV move at the swap (``move_kv`` -> a ``slot_moves``
program whose rows are cache slots, in fixed rounds): its programs lowered and compiled ahead
(``lower_kv_move``, as a rescale's build units do), then the move four times (run only; the programs
compiled during the moves are counted: 0 expected).

    PYTHONPATH=. python bench/multihost_kv_move.py [--blocks 8]

Starts the two processes itself (loopback coordinator, 4 CPU devices each) and prints process 0's
numbers as JSON. The moves: ``--blocks`` blocks of attention instance 1 (device 4, process 1) and half
as many of instance 0 (device 0) to blocks of new instances 0 and 1 (devices 0 and 1, process 0).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = dict(num_blocks=64, block_size=8, max_num_seqs=2, max_prefill_chunk=16, max_batch_tokens=32)


def worker(process_id: int, port: int, blocks: int, out: str) -> None:
    import jax

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=120
    )
    from jaxmoe import LLM
    from jaxmoe.compilation import compile_events
    from jaxmoe.janus.reshard import MoveStats, build_rescaled, lower_kv_move, move_kv, rescaled_spec

    llm = LLM("tiny-random", dtype="float32", mesh=str(ROOT / "meshes" / "cpu-2x4.yaml"), **ENGINE)
    ex = llm.executor
    t = time.perf_counter()
    new, stats = build_rescaled(ex, rescaled_spec(ex.sub.spec, 4, 4), ENGINE["num_blocks"] * ENGINE["block_size"])
    jax.block_until_ready(new.params)
    build_s = time.perf_counter() - t
    old_n, new_n = ex.kv_layout.blocks_per_instance, new.kv_layout.blocks_per_instance
    half = max(1, blocks // 2)
    moves = [
        (list(range(old_n, old_n + blocks)), list(range(new_n, new_n + blocks))),  # process 1 -> device 1
        (list(range(half)), list(range(half))),  # stays on device 0
    ]
    t = time.perf_counter()
    ahead = lower_kv_move(ex, new)  # what a rescale's build units do before the swap
    lower_s = time.perf_counter() - t
    compile_s = []
    for program in ahead:
        t = time.perf_counter()
        program.compile()
        compile_s.append(round(time.perf_counter() - t, 2))
    times, compiled = [], compile_events()["programs"]
    for _ in range(4):
        kv = MoveStats()
        t = time.perf_counter()
        move_kv(ex, new, moves, kv)
        jax.block_until_ready(new.cache)
        times.append(round(time.perf_counter() - t, 4))
    compiles_in_moves = compile_events()["programs"] - compiled
    result = {
        "process_id": process_id,
        "build_rescaled_s": round(build_s, 2),
        "expert_slots_copied": stats.expert_slots_copied,
        "kv_blocks_moved": kv.kv_blocks_moved,
        "kv_bytes_moved": kv.kv_bytes_moved,
        "kv_programs_lowered_s": round(lower_s, 2),
        "kv_programs_compile_s": compile_s,
        "kv_move_s": times,
        "compiles_in_moves": compiles_in_moves,
    }
    if out:
        Path(out).write_text(json.dumps(result))
    jax.distributed.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8, help="blocks of instance 1 moved to process 0")
    ap.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.process_id is not None:
        worker(args.process_id, args.port, args.blocks, args.out)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    out = Path(f"/tmp/jaxmoe-kv-move-{os.getpid()}.json")
    cmd = [sys.executable, __file__, "--blocks", str(args.blocks), "--port", str(port)]
    procs = [
        subprocess.Popen([*cmd, "--process-id", str(i), "--out", str(out) if i == 0 else ""], env=env, cwd=ROOT)
        for i in range(2)
    ]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL: jax's preemption notifier catches SIGTERM
    if codes != [0, 0]:
        print(f"workers exited {codes}", file=sys.stderr)
        return 1
    print(out.read_text())
    out.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
