"""One process of a multi-process jaxmoe run (spawned by tests/multihost/test_multiprocess.py, or by hand).

Every process runs this same script (multi-controller SPMD): it joins ``jax.distributed`` on
127.0.0.1, builds ``LLM("tiny-random", mesh=MESH)`` over the global devices (node n == process n; with
meshes/cpu-8-4a4e.yaml and 4 CPU devices per process, attention on process 0 and experts on
process 1; the executor picks ``cross_process.CrossProcessTransfer`` itself), generates for the
prompts (greedy; sampled, seeded and unseeded; greedy again after moving expert replicas) and
writes the tokens, expert activation counts and transfer counters as JSON. ``--relayout`` (with
meshes/cpu-8-1a7e.yaml) moves replicas between the processes with ``set_placement`` and records
tokens and logits; ``--rescale`` re-scales the engine while requests run.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
      python tests/multihost/multiprocess_worker.py --process-id 0 --num-processes 2 --port 23456 --out out0.json &
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
      python tests/multihost/multiprocess_worker.py --process-id 1 --num-processes 2 --port 23456 --out out1.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The mixture of experts", "Hello, world"]
ENGINE = dict(num_blocks=64, block_size=8, max_num_seqs=4)
SAMPLE_SEED = 1234
# --relayout: token rows for teacher-forced logits, and the placements the experts move through
# (meshes/cpu-8-1a7e.yaml: 7 expert instances x 4 slots, instances 0-2 on process 0, 3-6 on
# process 1). FORCED_1A7E: experts with 2-3 replicas and unused slots; SPLIT: experts 0-3 only on
# process 0, 4-7 only on process 1; SWAPPED: the other way round (every moved slot crosses).
LOGIT_ROWS = [[7, 21, 33, 5, 90, 17, 64, 12, 48, 101, 9], [11, 3, 77, 29, 54]]
LOGIT_TABLES = [[40, 5], [9, 50]]
FORCED_1A7E = [0, 1, 2, -1, 3, 4, 5, 6, 7, 0, 1, -1, 2, 3, 4, 5, 6, 7, 0, -1, 1, 2, 3, -1, 4, 5, 6, 7]
SPLIT_1A7E = [0, 1, 2, 3] * 3 + [4, 5, 6, 7] * 4
SWAPPED_1A7E = [4, 5, 6, 7] * 3 + [0, 1, 2, 3] * 4
# --rescale: from meshes/cpu-8-1a7e.yaml through these layouts (attention stays on process 0; the
# expert side, on both processes in 1a7e, moves inside process 1 (4a4e: experts the devices of
# process 0 held are copied over), then back onto both). Few serving shapes: each change compiles
# them all before the swap.
RESCALES = [(4, 4), (1, 7)]
RESCALE_ENGINE = dict(num_blocks=64, block_size=8, max_num_seqs=2, max_prefill_chunk=16, max_batch_tokens=32)
RESCALE_REQUESTS = 7
# while a build runs the engine is kept full (RESCALE_ENGINE's 2 sequences) up to this many requests in
# all, so that sequences live through the swap (their KV blocks move; the "beside" build serves ~290
# steps at load 10-15); a few more are kept for a first step after a swap made while idle
RESCALE_MAX_REQUESTS = 80
RESCALE_FIRST_STEP_REQUESTS = 4


def rescale_request(i: int):
    """Request i of the --rescale load: (prompt token ids, max_tokens), both from the seed i."""
    import numpy as np

    rng = np.random.default_rng(i)
    return [int(t) for t in rng.integers(3, 250, size=int(rng.integers(3, 30)))], 6 + (i * 7) % 17


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--port", type=int, required=True, help="coordinator port on 127.0.0.1")
    ap.add_argument("--mesh", default=str(ROOT / "meshes" / "cpu-8-4a4e.yaml"))
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--prompts", default=json.dumps(PROMPTS), help="JSON list of prompts")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument(
        "--probe",
        action="store_true",
        help="no model: record what jax.device_put across processes does, and check the "
        "collective a2e / e2a on random data",
    )
    ap.add_argument(
        "--dcn-port",
        type=int,
        default=0,
        help="with --probe: enable jax's experimental DCN cross-host device_put, this "
        "process listening on 127.0.0.1:DCN_PORT",
    )
    ap.add_argument(
        "--relayout",
        action="store_true",
        help="greedy tokens and logits before and after set_placement moves replicas between the "
        "processes (use with meshes/cpu-8-1a7e.yaml: the expert side spans both)",
    )
    ap.add_argument(
        "--rescale",
        action="store_true",
        help="live re-scaling under a bounded load: the layout changes RESCALES times while requests "
        "run (use with meshes/cpu-8-1a7e.yaml)",
    )
    ap.add_argument(
        "--rescale-form",
        default="beside",
        choices=["beside", "steps", "stop"],
        help="with --rescale: how the build compiles (LiveRescaler.across_processes)",
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    sys.path.insert(0, str(ROOT))
    import jax

    if "jax_cpu_collectives_implementation" in jax.config.values:  # gloo is the default on jax 0.10
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.dcn_port:  # must be set before the backend starts; port 0 (any port) hangs the receiver
        jax.config.update("jax_cross_host_transfer_socket_address", f"127.0.0.1:{args.dcn_port}")
        jax.config.update("jax_cross_host_transport_addresses", "127.0.0.1:0")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=120,
    )

    from jaxmoe import LLM, SamplingParams

    if args.probe:
        Path(args.out).write_text(json.dumps(probe(jax, args.mesh), indent=1))
        jax.distributed.shutdown()
        return 0
    if args.rescale:
        llm = LLM(args.model, dtype="float32", mesh=args.mesh, **RESCALE_ENGINE)
        Path(args.out).write_text(json.dumps(rescale(jax, llm, args.rescale_form), indent=1))
        jax.distributed.shutdown()
        return 0
    llm = LLM(args.model, dtype="float32", mesh=args.mesh, **ENGINE)
    if args.relayout:
        Path(args.out).write_text(json.dumps(relayout(jax, llm, args), indent=1))
        jax.distributed.shutdown()
        return 0
    ex = llm.executor
    t_built = time.perf_counter()
    prompts = json.loads(args.prompts)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    t_done = time.perf_counter()
    counts = ex.expert_activation_counts()  # collectives: every process reads them
    activated = ex.activated_per_instance()
    # temperature > 0: the first request seeded, the others not (the engine draws their seeds)
    sampled = llm.generate(
        prompts,
        [
            SamplingParams(
                max_tokens=args.max_tokens, temperature=0.8, ignore_eos=True, seed=SAMPLE_SEED if i == 0 else None
            )
            for i in range(len(prompts))
        ],
    )
    # move replicas (expert side inside process 1), then greedy again
    S, C = len(ex.placement()), ex.slots_per_instance
    moved = ex.set_placement([ex.placement()[(s + C) % S] for s in range(S)])
    relaid = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))

    sub, transfer = ex.sub, ex.transfer
    result = {
        "process_id": jax.process_index(),
        "process_count": jax.process_count(),
        "transfer": type(transfer).__name__,
        "tokens": [list(o.token_ids) for o in greedy],
        "routed_tokens": sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in greedy),
        "expert_activation_counts": counts,
        "activated_per_instance": {str(k): v for k, v in activated.items()},
        "sampled_tokens": [list(o.token_ids) for o in sampled],
        "moved": moved,
        "relaid_tokens": [list(o.token_ids) for o in relaid],
        "attention_devices": sorted({d.process_index for d in sub.attention.devices.flat}),
        "expert_devices": sorted({d.process_index for d in sub.experts.devices.flat}),
        "transfer_stats": {str(k): v for k, v in ex.transfer_stats().items()},
        "cross_process": {k: dataclasses.asdict(v) for k, v in transfer.counts.items()},
        "collectives": dict(transfer.collectives),
        "seconds": {"build": t_built - t0, "generate": t_done - t_built},
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    jax.distributed.shutdown()
    return 0


def logits(llm) -> list[list[float]]:
    """Prefill logits of LOGIT_ROWS at their last tokens (teacher-forced, no sampling)."""
    from jaxmoe.engine.model_runner import Row

    rows = [Row(p, 0, t) for p, t in zip(LOGIT_ROWS, LOGIT_TABLES)]
    return [[float(v) for v in row] for row in llm.engine.runner.forward(rows)]


def relayout(jax, llm, args) -> dict:
    """Greedy tokens and logits before and after two ``set_placement`` calls that move replicas
    between the processes (the expert sub-mesh spans both), the slots moved, the collective
    rounds and rows, and a check of this process' slot shards against the logical weights."""
    import numpy as np

    from jaxmoe import SamplingParams
    from jaxmoe.checkpoint.model import load_model
    from jaxmoe.runtime.slot_moves import mover_for

    ex = llm.executor
    prompts = json.loads(args.prompts)
    greedy = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    ref = load_model(args.model, dtype="float32")[1]
    mover = mover_for(ex.sub)

    def slots_ok() -> tuple[bool, int]:
        """Every slot row this process holds == the logical weights of its expert (zeros if unused)."""
        ok, checked = True, 0
        for i in ex.moe_layers:
            placement = ex.placement(i)
            for k in ("w_gate", "w_up", "w_down"):
                want = np.asarray(ref["layers"][i]["moe"][k])
                for shard in ex.params["layers"][i]["moe"][k].addressable_shards:
                    data, first = np.asarray(shard.data), shard.index[0].start or 0
                    for r in range(data.shape[0]):
                        e = placement[first + r]
                        ok &= bool(np.array_equal(data[r], want[e] if e >= 0 else np.zeros_like(want[0])))
                        checked += 1
        return ok, checked

    out: dict = {
        "process_id": jax.process_index(),
        "expert_processes": sorted({d.process_index for d in ex.sub.experts.devices.flat}),
        "transfer": type(ex.transfer).__name__,
        "phases": [],
    }
    placements = [("start", None), ("forced", FORCED_1A7E), ("split", SPLIT_1A7E), ("swapped", SWAPPED_1A7E)]
    for name, placement in placements:
        t = time.perf_counter()
        moved = ex.set_placement(placement) if placement is not None else 0
        seconds = time.perf_counter() - t
        ok, checked = slots_ok()
        outs = llm.generate(prompts, greedy)
        out["phases"].append(
            {
                "name": name,
                "placement": ex.placement(),
                "moved": moved,
                "seconds": seconds,
                "rows_moved": mover.rows_moved,
                "rows_across_processes": mover.rows_across_processes,
                "collectives": mover.collectives,
                "slots_ok": ok,
                "slots_checked": checked,
                "tokens": [list(o.token_ids) for o in outs],
                "logits": logits(llm),
            }
        )
    # the placement controller (JANUS Algorithm 2) as a step hook: it reads the co-activation
    # counters (a collective) and calls set_placement every 3 steps, on every process alike
    from jaxmoe.janus.placement_controller import PlacementController

    controller = PlacementController.attach(llm.engine, 3)
    outs = llm.generate(prompts, greedy)
    llm.engine.hooks.remove(controller)
    out["controller"] = {
        "tokens": [list(o.token_ids) for o in outs],
        "rebalances": len(controller.history),
        "slots_moved": sum(r.slots_moved for r in controller.history),
        "placements": [ex.placement(i) for i in ex.moe_layers],
        "rows_across_processes": mover.rows_across_processes,
    }
    return out


def rescale(jax, llm, form: str = "steps") -> dict:
    """The engine re-scaled RESCALES times while requests run (every process calls ``start`` at the
    same step: parameters move there, the programs compile one unit before each step or idle
    ``apply``, and the processes swap once every one has built). Returns the
    final tokens per request, each change's ``RescaleResult``, the layouts and the free KV blocks."""
    from jaxmoe import SamplingParams
    from jaxmoe.runtime.slot_moves import mover_for

    engine = llm.engine
    final, added, results, layouts, crossed = {}, [], [], [], []

    def add(i):
        prompt, max_tokens = rescale_request(i)
        added.append(engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), "be", f"r{i}"))

    def step():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out

    from jaxmoe.janus.live_rescale import LiveRescaler, RescaleError

    rescaler = LiveRescaler.of(engine)
    rescaler.across_processes = form

    try:  # 5a4e: 9 instances on 8 devices: refused on every process, nothing changes
        rescaler.start(5, 4)
        refused = None
    except RescaleError as e:
        refused = str(e)
    for i in range(3):
        add(i)
    for attention, experts in RESCALES:
        for _ in range(2):
            step()
        if len(added) < RESCALE_REQUESTS:
            add(len(added))
        t = time.perf_counter()
        print(f"rescale to {attention}a{experts}e: building", flush=True)
        job = rescaler.start(attention, experts)
        print(f"rescale to {attention}a{experts}e: started in {time.perf_counter() - t:.1f} s", flush=True)
        for _ in range(500_000):  # bounded: the processes agree on the swap once every one has built
            if job.done():
                break
            live = len(engine.scheduler.sequences())
            building = len(added) < RESCALE_MAX_REQUESTS - RESCALE_FIRST_STEP_REQUESTS
            if not job.swapped and live < RESCALE_ENGINE["max_num_seqs"] and building:
                add(len(added))  # the old layout serves a full engine during the build (the same on every process)
            if engine.has_work():
                step()
            elif job.swapped and len(added) < RESCALE_MAX_REQUESTS:  # swapped while idle: a first step on it
                add(len(added))
            elif job.swapped:
                rescaler.apply()  # nothing left to add: done, idle
            else:
                step()  # idle: no model step, but the hooks run (the next build unit, the agreement)
                if job.units is None and not job.swapped:
                    time.sleep(0.02)  # ("beside": compiling) ask again (every process makes the same calls)
        if not job.done():  # the loop's bound: say where the build stands
            pending = [f.done() for f in job.compiles or []]
            print(
                f"not done: units left {job.units is not None}, units run {job.units_run}, ready {job.ready()}, "
                f"compiles {sum(pending)}/{len(pending)} done, steps {job.steps_during_build}, added {len(added)}, "
                f"work {engine.has_work()}",
                flush=True,
            )
        results.append(job.result(timeout=0).as_dict())
        print(f"rescale to {attention}a{experts}e: serving", flush=True)
        ex = llm.executor
        layouts.append(
            [ex.num_attention, ex.num_expert_instances, sorted({d.process_index for d in ex.sub.experts.devices.flat})]
        )
        crossed.append(mover_for(ex.sub).rows_across_processes)
    for _ in range(2000):  # bounded
        if not engine.has_work():
            break
        step()
    bm = engine.block_manager
    return {
        "process_id": jax.process_index(),
        "added": added,
        "tokens": {rid: list(o.token_ids) for rid, o in final.items()},
        "errors": {rid: o.error for rid, o in final.items() if o.error is not None},
        "finish": {rid: o.finish_reason for rid, o in final.items()},
        "results": results,
        "layouts": layouts,
        "rows_across_processes": crossed,
        "blocks_free": [bm.num_free, bm.num_blocks],
        "refused": refused,
    }


def probe(jax, mesh_file: str) -> dict:
    """jax.device_put from the attention mesh to the expert mesh (another process), and the
    collective transfer, on x [4 rows per attention instance, 8] and partials [n, B, 8]."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxmoe.mesh import build_meshes, load_mesh
    from jaxmoe.runtime.cross_process import CrossProcessTransfer

    sub = build_meshes(load_mesh(mesh_file))
    m, n = sub.spec.attention.count, sub.spec.experts.count
    rng = np.random.default_rng(0)
    x_host = rng.standard_normal((4 * m, 8), dtype=np.float32)
    y_host = rng.standard_normal((n, 4 * m, 8), dtype=np.float32)
    x = jax.device_put(x_host, sub.batch_sharding)
    y = jax.device_put(y_host, sub.partials_sharding)
    out: dict = {"process_id": jax.process_index()}

    def attempt(name, fn):
        try:
            got = jax.block_until_ready(fn())
            shards = [np.asarray(s.data) for s in got.addressable_shards]
            out[name] = {"ok": True, "local_shards": len(shards), "shards": [s.tolist() for s in shards]}
        except Exception as exc:  # noqa: BLE001 - recording what jax raises is the point
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}

    # a2e as device_put: P("attn") on the attention mesh -> replicated on the expert mesh
    attempt("device_put_replicated", lambda: jax.device_put(x, sub.replicated_sharding))
    # the same layout on both sides (rows split over the instances of each side)
    same = NamedSharding(sub.experts, P(sub.experts.axis_names[0]))
    attempt("device_put_same_layout", lambda: jax.device_put(x, same))
    # the mechanism used instead
    xp = CrossProcessTransfer(sub)
    xe, ya = xp.a2e(x), xp.e2a(y)
    out["a2e_local_shards"] = len(xe.addressable_shards)
    out["a2e_ok"] = all(np.array_equal(np.asarray(s.data), x_host) for s in xe.addressable_shards)
    out["e2a_ok"] = bool(np.allclose(xp.fetch(ya), y_host.sum(0), rtol=1e-5, atol=1e-5))
    out["fetch_ok"] = bool(np.array_equal(xp.fetch(xe), x_host))
    out["x_host"] = x_host.tolist()
    return out


if __name__ == "__main__":
    sys.exit(main())
