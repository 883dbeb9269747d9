"""One process of a multi-process jaxmoe run (spawned by tests/test_multiprocess.py, or by hand).

Every process runs this same script (multi-controller SPMD): it joins ``jax.distributed`` on
127.0.0.1, builds ``LLM("demo", mesh=MESH)`` over the global devices (node n == process n; with
meshes/cpu-8-4a4e.yaml and 4 CPU devices per process, attention on process 0 and experts on
process 1), routes A2E / E2A through ``jaxmoe.runtime.cross_process.CrossProcessTransfer``,
greedy-generates for the prompts and writes the tokens (and transfer counters) as JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
      python tests/multiprocess_worker.py --process-id 0 --num-processes 2 --port 23456 --out out0.json &
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
      python tests/multiprocess_worker.py --process-id 1 --num-processes 2 --port 23456 --out out1.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The mixture of experts", "Hello, world"]
ENGINE = dict(num_blocks=64, block_size=8, max_num_seqs=4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--port", type=int, required=True, help="coordinator port on 127.0.0.1")
    ap.add_argument("--mesh", default=str(ROOT / "meshes" / "cpu-8-4a4e.yaml"))
    ap.add_argument("--model", default="demo")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--prompts", default=json.dumps(PROMPTS), help="JSON list of prompts")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--probe", action="store_true",
                    help="no model: record what jax.device_put across processes does, and check the "
                         "collective a2e / e2a on random data")
    ap.add_argument("--dcn-port", type=int, default=0,
                    help="with --probe: enable jax's experimental DCN cross-host device_put, this "
                         "process listening on 127.0.0.1:DCN_PORT")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    sys.path.insert(0, str(ROOT))
    import jax

    if "jax_cpu_collectives_implementation" in jax.config.values:  # gloo is the default on jax 0.10
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.dcn_port:  # must be set before the backend starts; port 0 (any port) hangs the receiver
        jax.config.update("jax_cross_host_transfer_socket_address", f"127.0.0.1:{args.dcn_port}")
        jax.config.update("jax_cross_host_transport_addresses", "127.0.0.1:0")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=120)

    from jaxmoe import LLM, SamplingParams
    from jaxmoe.runtime.cross_process import CrossProcessTransfer

    if args.probe:
        Path(args.out).write_text(json.dumps(probe(jax, args.mesh), indent=1))
        jax.distributed.shutdown()
        return 0
    _dtype_for_remote_callbacks(jax)
    made: list = []

    def make_transfer(sub):
        made.append(CrossProcessTransfer(sub))
        return made[-1]

    llm = LLM(args.model, dtype="float32", mesh=args.mesh, **ENGINE, **executor_kwargs(make_transfer))
    transfer, wiring = attach(llm.executor, made[0] if made else None, CrossProcessTransfer)
    t_built = time.perf_counter()
    outs = llm.generate(json.loads(args.prompts), SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    t_done = time.perf_counter()

    sub = llm.executor.sub
    result = {
        "process_id": jax.process_index(),
        "process_count": jax.process_count(),
        "wiring": wiring,
        "tokens": [list(o.token_ids) for o in outs],
        "attention_devices": sorted({d.process_index for d in sub.attention.devices.flat}),
        "expert_devices": sorted({d.process_index for d in sub.experts.devices.flat}),
        "transfer_stats": {str(k): v for k, v in llm.executor.transfer_stats().items()},
        "cross_process": {k: dataclasses.asdict(v) for k, v in transfer.counts.items()},
        "collectives": dict(transfer.collectives),
        "seconds": {"build": t_built - t0, "generate": t_done - t_built},
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    jax.distributed.shutdown()
    return 0


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
            out[name] = {"ok": True, "local_shards": len(shards),
                         "shards": [s.tolist() for s in shards]}
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


def executor_kwargs(make_transfer) -> dict:
    """``LLM`` keyword arguments that hand the executor the cross-process transfer, when
    ``DisaggregatedExecutor`` takes a ``transfer`` (a factory called with its SubMeshes)."""
    import inspect

    from jaxmoe.llm import LLM
    from jaxmoe.runtime.disaggregated import DisaggregatedExecutor

    if ("transfer" in inspect.signature(DisaggregatedExecutor).parameters
            and "executor_kwargs" in inspect.signature(LLM).parameters):
        return {"executor_kwargs": {"transfer": make_transfer}}
    return {}


def attach(executor, transfer, transfer_cls):
    """Complete the wiring the executor does not do itself; returns (transfer, how).

    * A2E / E2A: through ``DisaggregatedExecutor(transfer=...)`` when it has that hook
      (``transfer`` is then the instance it made); otherwise the module-level functions that
      ``forward`` calls are swapped for the transfer's.
    * Logits: the engine samples on every process, so ``forward`` must return an array this
      process can read. Unless ``forward`` already calls ``to_local`` (decided from its source,
      so that every process decides the same way: ``to_local`` is a collective), it is wrapped.
    """
    import inspect

    import jaxmoe.runtime.disaggregated as disaggregated

    how = []
    if transfer is None:
        transfer = transfer_cls(executor.sub)
        disaggregated.a2e_transfer = transfer.a2e
        disaggregated.e2a_transfer = transfer.e2a
        how.append("a2e/e2a: patched module functions")
    else:
        how.append("a2e/e2a: DisaggregatedExecutor(transfer=...)")
    if "to_local" in inspect.getsource(type(executor).forward):
        how.append("logits: executor")
    else:
        forward = executor.forward

        def local_forward(*args, **kwargs):
            return transfer.to_local(forward(*args, **kwargs))

        executor.forward = local_forward
        how.append("logits: forward wrapped with to_local")
    return transfer, "; ".join(how)


def _dtype_for_remote_callbacks(jax) -> None:
    """Stopgap: ``expert_program.place_layer`` calls ``jax.make_array_from_callback`` without
    ``dtype``, which raises ``ValueError: If the Array has no addressable shards, `dtype` must be
    provided`` on a process holding no expert device. Until it passes ``dtype=host.dtype``, a
    call without dtype on such a sharding gets it from the callback's first shard (computed on
    the host, never placed). A no-op when dtype is given."""
    make = jax.make_array_from_callback
    if getattr(make, "_jaxmoe_shim", False):
        return

    def make_array_from_callback(shape, sharding, data_callback, dtype=None, **kw):
        if dtype is None and not sharding.addressable_devices:
            index = next(iter(sharding.devices_indices_map(tuple(shape)).values()))
            dtype = getattr(data_callback(index), "dtype", None)
        return make(shape, sharding, data_callback, dtype=dtype, **kw)

    make_array_from_callback._jaxmoe_shim = True
    jax.make_array_from_callback = make_array_from_callback


if __name__ == "__main__":
    sys.exit(main())
