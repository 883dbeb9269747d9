"""``jaxmoe lower``: every program serving a model would compile, lowered for CUDA and TPU (or any
JAX platform) on a machine with no device of that platform.

What is lowered is what warm-up compiles (``engine.warmup``) for each shape of the engine's
``ShapePlan`` (``engine.buckets``), built by the same factories the executors use:

* monolithic (no mesh file): per bucket the fused step (``runtime.monolithic.step_program``), or
  where layer preemption is on (``jaxmoe serve``'s default there; ``--no-layer-preemption``: off) the
  layer-by-layer programs every step runs instead, pausable or not
  (``runtime.monolithic.layer_programs``: ``embed``, each layer group's ``layers``, ``head``), and
  the sampler (``sampling.sample``) per batch size;
* disaggregated (a mesh file): per bucket the attention side's ``embed``, one ``layer`` per kind
  of layer (dense / MoE; every layer of a kind shares it), ``shared`` (shared experts on the
  attention side) and ``head`` (``runtime.attention_program``), the expert program of each kind of
  MoE layer (``runtime.expert_program``: gate, AEBS, expert FFN), the A2E / E2A collectives when
  the cluster spans nodes (one process per node: ``runtime.cross_process``; inside one process a
  transfer is ``jax.device_put`` hops, no program), and the sampler.

Nothing touches a device: parameters are ``jax.ShapeDtypeStruct`` read from the checkpoint's
headers, meshes are ``jax.sharding.AbstractMesh`` of the mesh file's shape, and every program is
traced inside ``pallas_kernels.platform.lowering_for(platform)`` so the kernels are the ones that
platform would pick, then lowered with ``lowering_platforms=(platform,)``.

``--compile`` also compiles ahead where JAX can without the device (``compile_target``): TPU
through libtpu's topology description (``jax.experimental.topologies``) when libtpu is installed;
CUDA needs a CUDA-enabled jaxlib and the GPU's target description, which this build does not
take, so CUDA programs are reported as lowered only, with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

JAX_PLATFORMS = {"cuda": "cuda", "gpu": "cuda", "rocm": "rocm", "tpu": "tpu", "cpu": "cpu"}


@dataclasses.dataclass(frozen=True)
class Program:
    """One program serving compiles: a name and how to trace it (called inside ``lowering_for``)."""

    name: str
    trace: Callable  # () -> jax.stages.Traced


@dataclasses.dataclass
class ProgramResult:
    name: str
    platform: str
    ok: bool
    error: str | None = None
    compiled: bool = False  # compiled ahead too (``--compile``)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- the model, abstractly


def abstract_model(model: str | Path, dtype=None):
    """(config, parameter tree of ``jax.ShapeDtypeStruct``) of a checkpoint without reading its
    weights: an HF checkpoint's safetensors headers (checked against the config like a load), a
    converted checkpoint's metadata; the built-in names load their (small) weights."""
    import jax
    import jax.numpy as jnp

    from jaxmoe.checkpoint import is_converted
    from jaxmoe.checkpoint.hf_names import param_plan
    from jaxmoe.checkpoint.loader import check_checkpoint, empty_tree, set_leaf
    from jaxmoe.checkpoint.safetensors_reader import SafetensorsCheckpoint
    from jaxmoe.config import load_config
    from jaxmoe.demo import TINY_RANDOM

    path = Path(model)
    if str(model) in ("demo", TINY_RANDOM) or (path.is_dir() and is_converted(path)):
        from jaxmoe.checkpoint.model import load_model

        cfg, params, _ = load_model(model, dtype)
        return cfg, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    if not path.is_dir():
        raise FileNotFoundError(f"model {str(model)!r} is neither a built-in name nor a checkpoint directory")
    cfg = load_config(path)
    ckpt = SafetensorsCheckpoint(path)
    check_checkpoint(ckpt, cfg)
    params = empty_tree(cfg)
    for leaf in param_plan(cfg):
        shape = tuple(leaf.shape)
        if leaf.transpose:
            shape = shape[:-2] + (shape[-1], shape[-2])
        if leaf.stack:
            shape = (len(leaf.sources),) + shape
        leaf_dtype = jnp.dtype(dtype) if dtype is not None else ckpt.dtype(leaf.sources[0])
        set_leaf(params, leaf.path, jax.ShapeDtypeStruct(shape, leaf_dtype))
    return cfg, params


def _sds(shape, dtype, sharding=None):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _step_inputs(B: int, T: int, max_blocks: int, sharding=None):
    """tokens, AttentionBatch, logits_index of a [B, T] step (int32), as ``ModelRunner`` builds them."""
    import jax.numpy as jnp

    from jaxmoe.models.attention import AttentionBatch

    i32 = jnp.int32
    batch = AttentionBatch(
        _sds((B, T), i32, sharding), _sds((B, T), i32, sharding), _sds((B, max_blocks), i32, sharding)
    )
    return _sds((B, T), i32, sharding), batch, _sds((B,), i32, sharding)


def _sampler(B: int, vocab: int, logits_dtype, sharding=None) -> Program:
    """The sampler program for B rows (``sampling.sample``: the argument order of
    ``ModelRunner._execute``)."""
    import jax.numpy as jnp

    from jaxmoe.sampling import sample

    def trace():
        f32, i32 = jnp.float32, jnp.int32
        logits = _sds((B, vocab), logits_dtype, sharding)
        per_row = [_sds((B,), t, sharding) for t in (f32, i32, f32, f32, jnp.uint32, i32)]  # temperature .. steps
        return sample.trace(logits, logits, *per_row, _sds((), jnp.bool_, sharding))

    return Program(f"sampler[B={B}]", trace)


def _logit_adjuster(B: int, vocab: int, window: int, logits_dtype, sharding=None) -> Program:
    """The program that applies penalties and logit bias before sampling (``sampling.adjust_logits``),
    for B rows and a ``window``-token history."""
    import jax.numpy as jnp

    from jaxmoe.sampling import MAX_LOGIT_BIAS, adjust_logits

    def trace():
        f32, i32 = jnp.float32, jnp.int32
        args = (
            _sds((B, vocab), logits_dtype, sharding),
            *(_sds((B,), f32, sharding) for _ in range(3)),  # presence, frequency, repetition
            _sds((B, window), i32, sharding),
            _sds((B,), i32, sharding),
            _sds((B, MAX_LOGIT_BIAS), i32, sharding),
            _sds((B, MAX_LOGIT_BIAS), f32, sharding),
        )
        return adjust_logits.trace(*args)

    return Program(f"adjust_logits[B={B}]", trace)


def _logits_dtype(params) -> object:
    import jax.numpy as jnp

    head = params.get("lm_head", params["embed"])
    return jnp.result_type(params["embed"].dtype, head.dtype)


# --------------------------------------------------------------------------- monolithic


def monolithic_programs(
    cfg, params: dict, engine_config, shapes: list[tuple[int, int]], devices=None, layer_by_layer: bool = True
) -> Iterator[Program]:
    """The programs of ``MonolithicExecutor`` + ``ModelRunner`` for each (rows, tokens) shape
    (``devices``: on the first of these, e.g. a TPU topology's, to compile ahead; None: unplaced);
    ``layer_by_layer``: those of layer-level preemption instead of the fused step (``embed``, one
    ``layers`` program per layer group whatever ``pause_every``, ``head``: what every step of a
    serving loop runs then, ``MonolithicExecutor.split_step``)."""
    import jax

    from jaxmoe.kv_layout import KVLayout
    from jaxmoe.models.experts import AUTO_EXPERT_IMPL
    from jaxmoe.models.transformer import in_place_mode, init_stacked_cache, stack_layers, store_as_panels
    from jaxmoe.pallas_kernels.expert_ffn import resolve
    from jaxmoe.models.routing import TopKRouting
    from jaxmoe.runtime.monolithic import layer_programs, step_program

    impl = resolve(engine_config.expert_impl, AUTO_EXPERT_IMPL)
    stacked = jax.eval_shape(stack_layers, params)
    if in_place_mode(impl):  # the executor stores the experts as column panels for the CPU kernel
        stacked = jax.eval_shape(store_as_panels, stacked)
    slots = KVLayout.for_slots(engine_config.num_blocks * engine_config.block_size, engine_config.block_size).num_slots
    cache = jax.eval_shape(lambda s: init_stacked_cache(cfg, s, slots, params["embed"].dtype), stacked)
    one = None if devices is None else jax.sharding.SingleDeviceSharding(devices[0])
    if one is not None:
        stacked, cache = _shaped(stacked, one), _shaped(cache, one)
    step = step_program(cfg, engine_config.block_size, impl, TopKRouting())
    dtype = stacked["embed"].dtype
    embed, layers, head = layer_programs(
        cfg, engine_config.block_size, impl, TopKRouting(), dtype, in_place=in_place_mode(impl)
    )
    max_blocks = _max_blocks(cfg, engine_config)
    seen: set[int] = set()
    for rows, T in shapes:
        tokens, batch, index = _step_inputs(rows, T, max_blocks, one)
        if not layer_by_layer:
            yield Program(
                f"monolithic.step[{rows}x{T}]",
                lambda tokens=tokens, batch=batch, index=index: step.trace(stacked, tokens, batch, cache, index, None),
            )
        else:
            x = _sds((rows, T, cfg.hidden_size), dtype, one)
            yield Program(f"monolithic.embed[{rows}x{T}]", lambda tokens=tokens: embed.trace(stacked, tokens))
            scalar = _sds((), np.int32, one)  # the first layer and the layer count: traced
            for g, group in enumerate(stacked["groups"]):
                yield Program(
                    f"monolithic.layers[group {g}][{rows}x{T}]",
                    lambda group=group, g=g, x=x, batch=batch: layers.trace(
                        group, x, batch, cache[g], scalar, None, scalar
                    ),
                )
            yield Program(f"monolithic.head[{rows}x{T}]", lambda x=x, index=index: head.trace(stacked, x, index))
        if rows not in seen:
            seen.add(rows)
            yield _sampler(rows, cfg.vocab_size, _logits_dtype(params), one)
            window = max_blocks * engine_config.block_size
            yield _logit_adjuster(rows, cfg.vocab_size, window, _logits_dtype(params), one)


def _max_blocks(cfg, engine_config) -> int:
    max_len = min(engine_config.max_model_len or cfg.max_position, cfg.max_position)
    return -(-max_len // engine_config.block_size)


# --------------------------------------------------------------------------- disaggregated


def abstract_sub_meshes(spec, devices=None):
    """``SubMeshes`` of ``spec`` over ``jax.sharding.AbstractMesh`` (the mesh file's shape, no
    devices): what the program factories need to trace and lower. ``devices``: concrete meshes
    over these instead (device index d -> ``devices[d]``, e.g. a TPU topology's, to compile ahead),
    whatever their platform."""
    import jax
    from jax.sharding import AbstractMesh, Mesh

    from jaxmoe.mesh import ATTN_AXES, EXPERT_AXES, SubMeshes

    auto = (jax.sharding.AxisType.Auto,) * 2

    def mesh(side, axes):
        if devices is not None:
            grid = np.array([[devices[d] for d in inst] for inst in side.devices], dtype=object)
            return Mesh(grid, axes, axis_types=auto)
        return AbstractMesh((side.count, side.devices_per_instance), axes, axis_types=auto)

    nodes = tuple(spec.node_of(d) for d in range(spec.num_devices))
    used = () if devices is None else tuple(devices[: spec.num_devices])
    return SubMeshes(spec, mesh(spec.attention, ATTN_AXES), mesh(spec.experts, EXPERT_AXES), used, nodes)


def _shaped(tree, shardings):
    """``tree``'s ShapeDtypeStructs with the shardings of the matching tree (or one sharding)."""
    import jax

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda a: _sds(a.shape, a.dtype, shardings), tree)
    return jax.tree.map(lambda a, s: _sds(a.shape, a.dtype, s), tree, shardings)


def _kind_key(tree) -> tuple:
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    return (str(treedef), tuple((a.shape, str(a.dtype)) for a in leaves))


def _layer_kinds(trees: dict[int, dict]) -> list[tuple[list[int], dict]]:
    """Layers grouped by pytree structure and shapes (one compiled program each), in layer order."""
    kinds: dict[tuple, tuple[list[int], dict]] = {}
    for i, tree in trees.items():
        kinds.setdefault(_kind_key(tree), ([], tree))[0].append(i)
    return list(kinds.values())


def _ranges(indices: list[int]) -> str:
    from jaxmoe.mesh_spec import _ranges as ranges

    return ranges(indices)


def disaggregated_programs(
    cfg,
    params: dict,
    engine_config,
    spec,
    shapes: list[tuple[int, int]],
    replica_policy: str = "aebs",
    aebs_impl=None,
    devices=None,
) -> Iterator[Program]:
    """The programs of ``DisaggregatedExecutor`` + ``ModelRunner`` on ``spec`` for each (rows per
    attention instance, tokens) shape, on abstract sub-meshes (``devices``: on these devices'
    meshes, ``abstract_sub_meshes``)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxmoe.kv_layout import KVLayout
    from jaxmoe.models.attention import init_layer_cache
    from jaxmoe.pallas_kernels.expert_ffn import resolve
    from jaxmoe.runtime import attention_tp
    from jaxmoe.runtime.attention_program import attention_side_params, head_params, make_attention_programs
    from jaxmoe.runtime.expert_program import (
        _SHARED_SPECS,
        AUTO_EXPERT_IMPL,
        check_tp,
        make_expert_program,
        slot_spec,
    )
    from jaxmoe.runtime.replicas import ReplicaLayout, default_placement

    spec.validate_for(cfg.moe.num_experts)
    sub = abstract_sub_meshes(spec, devices)
    m, n = spec.attention.count, spec.experts.count
    C = spec.experts.slots_per_instance
    impl = resolve(engine_config.expert_impl, AUTO_EXPERT_IMPL)
    attention = make_attention_programs(cfg, engine_config.block_size, sub, impl == "cpu_kernel_invariant")
    kwargs = {} if aebs_impl is None else {"aebs_impl": aebs_impl}
    experts = make_expert_program(cfg, sub, C, policy=replica_policy, expert_impl=impl, **kwargs)
    dtype = params["embed"].dtype
    rep, rows_sh = attention.replicated, attention.rows
    erep = experts.replicated

    # attention side, as DisaggregatedExecutor places it
    def place_attention_layer(layer):
        layer = attention_side_params(layer)
        if attention.tp.size == 1:
            return _shaped(layer, rep)
        attn = jax.eval_shape(
            lambda a: attention_tp.expand_kv(a, attention.tp.cfg, attention.tp.kv_repeat), layer["attn"]
        )
        specs = attention_tp.param_specs(attn)
        out = {k: _shaped(v, rep) for k, v in layer.items() if k != "attn"}
        out["attn"] = {k: _sds(v.shape, v.dtype, NamedSharding(sub.attention, specs[k])) for k, v in attn.items()}
        return out

    layers = {i: place_attention_layer(layer) for i, layer in enumerate(params["layers"])}
    embed = _shaped(params["embed"], rep)
    head = _shaped(head_params(params, cfg), rep)
    shared_on_experts = spec.shared_experts == "experts"
    shared = (
        {}
        if shared_on_experts
        else {i: _shaped(ly["shared"], rep) for i, ly in enumerate(params["layers"]) if "shared" in ly}
    )
    kv = KVLayout.for_slots(engine_config.num_blocks * engine_config.block_size, engine_config.block_size, m)
    layer_cache = jax.eval_shape(lambda: init_layer_cache(attention.tp.cfg, kv.num_slots, dtype))
    layer_cache = {k: _sds(v.shape, v.dtype, attention.cache[k]) for k, v in layer_cache.items()}

    # expert side, as ExpertSide / expert_program.place_layer lay it out
    tp = check_tp(cfg, spec)
    E = cfg.moe.num_experts
    layout = ReplicaLayout(tuple(default_placement(E, n, C)), E, n, C)
    tables = {
        "replica_table": _sds(layout.replica_table().shape, jnp.int32, erep),
        "replica_instance": _sds(layout.replica_instance().shape, jnp.int32, erep),
    }

    def place_expert_layer(layer):
        moe = layer["moe"]
        out = {}
        for k, v in moe.items():
            if k in ("w_gate", "w_up", "w_down"):
                out[k] = _sds((layout.num_slots,) + v.shape[1:], v.dtype, NamedSharding(sub.experts, slot_spec(k, tp)))
            elif k not in ("united", "united_groups"):
                out[k] = _sds(v.shape, v.dtype, erep)
        if shared_on_experts and "shared" in layer:
            s = layer["shared"]
            F = s["w_gate"].shape[1] + (-s["w_gate"].shape[1] % n)
            padded = {
                "w_gate": (s["w_gate"].shape[0], F),
                "w_up": (s["w_up"].shape[0], F),
                "w_down": (F, s["w_down"].shape[1]),
            }
            out["shared"] = {
                k: _sds(padded.get(k, v.shape), v.dtype, NamedSharding(sub.experts, _SHARED_SPECS.get(k, P())))
                for k, v in s.items()
            }
        return out

    moe_layers = {i: place_expert_layer(ly) for i, ly in enumerate(params["layers"]) if "moe" in ly}
    max_blocks = _max_blocks(cfg, engine_config)
    attn_kinds = _layer_kinds(layers)
    expert_kinds = _layer_kinds(moe_layers)
    shared_kinds = _layer_kinds(shared)
    seen: set[int] = set()
    for rows, T in shapes:
        B = m * rows
        shape = f"{rows}x{T}"
        tokens, batch, index = _step_inputs(B, T, max_blocks, rows_sh)
        x = _sds((B, T, cfg.hidden_size), dtype, rows_sh)
        yield Program(f"attention.embed[{shape}]", lambda tokens=tokens: attention.embed.trace(embed, tokens))
        for ids, layer in attn_kinds:
            yield Program(
                f"attention.layer[{shape}, layers {_ranges(ids)}]",
                lambda layer=layer, x=x, batch=batch: attention.layer.trace(layer, x, x, batch, layer_cache, True),
            )
        for ids, p in shared_kinds:
            yield Program(
                f"attention.shared[{shape}, layers {_ranges(ids)}]",
                lambda p=p, x=x: attention.shared.trace(p, x, x),
            )
        yield Program(f"attention.head[{shape}]", lambda x=x, index=index: attention.head.trace(head, x, x, index))
        xe = _sds((B, T, cfg.hidden_size), dtype, erep)
        valid = _sds((B, T), jnp.bool_, erep)
        step = _sds((), jnp.int32, erep)
        coact = _sds((E, E), jnp.int32, erep)
        threshold = _sds((), jnp.float32, erep)
        for ids, p in expert_kinds:
            yield Program(
                f"experts[{shape}, layers {_ranges(ids)}]",
                lambda p=p, xe=xe, valid=valid: experts.run.trace(p, tables, xe, valid, step, coact, threshold),
            )
        if spec.nodes > 1 and moe_layers:
            yield from _transfer_programs(spec, B, T, cfg.hidden_size, dtype, shape, devices)
        if B not in seen:
            seen.add(B)
            one = None if devices is None else jax.sharding.SingleDeviceSharding(devices[0])
            yield _sampler(B, cfg.vocab_size, _logits_dtype(params), one)
            window = _max_blocks(cfg, engine_config) * engine_config.block_size
            yield _logit_adjuster(B, cfg.vocab_size, window, _logits_dtype(params), one)


def _transfer_programs(spec, B: int, T: int, D: int, dtype, shape: str, devices=None) -> Iterator[Program]:
    """A2E and E2A of a [B, T, D] step across processes (``cross_process``: one jitted ppermute
    program over all the cluster's devices each), on an abstract 1-D mesh of them."""
    from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

    from jaxmoe.runtime.cross_process import XFER, CrossProcessTransfer
    from jaxmoe.runtime.transfer import plan_transfers

    m = spec.attention.count
    if devices is None:  # the default axis type, as CrossProcessTransfer's Mesh has
        mesh = AbstractMesh((spec.num_devices,), (XFER,))
    else:
        mesh = Mesh(np.array(devices[: spec.num_devices], dtype=object), (XFER,))
    xfer = CrossProcessTransfer.for_lowering(spec, mesh)
    itemsize = np.dtype(dtype).itemsize
    plan = plan_transfers(spec, (B // m) * T * D * itemsize)
    sharding = NamedSharding(mesh, P(XFER))
    a2e, _ = xfer._build_a2e(plan)
    e2a, _ = xfer._build_e2a(plan)
    a2e_in = _sds((spec.num_devices * (B // m), T, D), dtype, sharding)
    e2a_in = _sds((spec.num_devices, B, T, D), dtype, sharding)
    yield Program(f"transfer.a2e[{shape}, {plan.strategy}]", lambda: a2e.trace(a2e_in))
    yield Program(f"transfer.e2a[{shape}, {plan.strategy}]", lambda: e2a.trace(e2a_in))


# --------------------------------------------------------------------------- lowering and compiling


def compile_target(platform: str, num_devices: int):
    """(devices to compile for, None) where JAX can compile ahead for ``platform`` without its
    devices, else (None, why not). TPU: the devices of a v5e slice's topology description
    (``jax.experimental.topologies``, from libtpu: ``pip install 'jaxmoe[tpu]'``)."""
    if platform == "tpu":
        try:
            from jax.experimental import topologies

            topology = topologies.get_topology_desc(platform="tpu", topology_name=_tpu_topology(num_devices))
        except Exception as e:  # no libtpu, or it does not describe this topology
            first = (str(e).strip().splitlines() or [""])[0][:200]
            return None, f"no TPU topology description here (libtpu: {type(e).__name__}: {first})"
        return list(topology.devices)[:num_devices], None
    if platform in ("cuda", "rocm"):
        return None, (
            "compiling for a GPU needs a jaxlib with that GPU's plugin and a target description; "
            "this jaxlib has none, so GPU programs are lowered only"
        )
    return None, "compiled on this machine's own devices by warm-up; lowered only here"


def _tpu_topology(num_devices: int) -> str:
    """A v5e topology name with ``num_devices`` chips (the slices meshes/ describes)."""
    shapes = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
    fits = [n for n in shapes if n >= num_devices]
    if not fits:
        raise ValueError(f"no v5e slice of {num_devices} chips")
    return f"v5e:{shapes[min(fits)]}"


def lower_all(
    model: str | Path,
    mesh: str | Path | None = None,
    platforms: tuple[str, ...] = ("cuda", "tpu"),
    dtype=None,
    engine_config=None,
    compile: bool = False,
    aebs_impl: str | None = None,
    log: Callable[[str], None] | None = None,
    layer_preemption: bool | None = None,
) -> dict:
    """Lower (and with ``compile``, compile where JAX can) every program serving ``model`` on
    ``mesh`` would compile, for each platform (``layer_preemption``: with the layer-by-layer programs
    of the monolithic executor's pausable steps, as ``jaxmoe serve`` runs them; None: as its default,
    on without a mesh file). Returns ``{"programs": [...], "ok": bool, "notes":
    {platform: what was done}}``; a program that fails is reported with its error, the others go on."""
    from jaxmoe.engine.buckets import ShapePlan
    from jaxmoe.engine.config import EngineConfig
    from jaxmoe.mesh import load_mesh
    from jaxmoe.pallas_kernels.platform import lowering_for

    engine_config = engine_config or EngineConfig()
    for p in platforms:
        if p not in JAX_PLATFORMS:
            raise ValueError(f"--platforms: unknown platform {p!r} (one of {', '.join(sorted(JAX_PLATFORMS))})")
    cfg, params = abstract_model(model, dtype)
    spec = None if mesh is None else load_mesh(mesh)
    max_len = min(engine_config.max_model_len or cfg.max_position, cfg.max_position)
    plan = ShapePlan(
        max_num_seqs=engine_config.max_num_seqs,
        max_prefill_chunk=min(engine_config.max_prefill_chunk, engine_config.max_batch_tokens, max_len),
    )
    shapes = plan.shapes()
    results: list[ProgramResult] = []
    notes: dict[str, str] = {}
    for name in platforms:
        platform = JAX_PLATFORMS[name]
        devices, why_not = (None, "not asked (--compile)") if not compile else compile_target(platform, _devices(spec))
        with lowering_for(platform):
            if spec is None:
                layered = not engine_config.deterministic if layer_preemption is None else layer_preemption
                programs = monolithic_programs(cfg, params, engine_config, shapes, devices, layered)
            else:
                programs = disaggregated_programs(
                    cfg, params, engine_config, spec, shapes, aebs_impl=aebs_impl, devices=devices
                )
            done = _run(programs, platform, devices is not None, results, log)
        notes[name] = (
            f"{done} programs lowered and compiled ahead"
            if devices is not None
            else f"{done} programs lowered only: {why_not}"
        )
    return {"programs": [r.to_json() for r in results], "ok": all(r.ok for r in results), "notes": notes}


def _devices(spec) -> int:
    return 1 if spec is None else spec.num_devices


def _run(programs: Iterator[Program], platform: str, compile: bool, results: list, log) -> int:
    count = 0
    while True:
        t0 = time.monotonic()
        try:
            program = next(programs)
        except StopIteration:
            return count
        except Exception as e:  # building the programs failed (e.g. the mesh does not fit the model)
            results.append(ProgramResult("(setup)", platform, False, _error(e), seconds=time.monotonic() - t0))
            if log is not None:
                log(f"{platform} (setup): FAILED: {results[-1].error}")
            return count
        count += 1
        result = ProgramResult(program.name, platform, True)
        try:
            lowered = program.trace().lower(lowering_platforms=(platform,))
            if compile:
                lowered.compile()
                result.compiled = True
        except Exception as e:  # reported per program; the others still lower
            result.ok, result.error = False, _error(e)
        result.seconds = round(time.monotonic() - t0, 3)
        results.append(result)
        if log is not None:
            log(f"{platform} {program.name}: {'ok' if result.ok else 'FAILED: ' + result.error}")


def _error(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:500]


# --------------------------------------------------------------------------- the command


def register(sub, add_model_args) -> None:
    """``jaxmoe lower``."""
    p = sub.add_parser(
        "lower",
        help="lower every program serving a model would compile, for CUDA / TPU, without their devices",
        description="Lower every program serving a model would compile (each warm-up shape, both executors, the "
        "kernels the platform picks) for CUDA / TPU without their devices; --compile also compiles where JAX can.",
    )
    add_model_args(p)
    p.add_argument("--platforms", default=None, help="comma-separated: cuda, tpu, rocm, cpu (default: cuda,tpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object (else one line per program)")
    p.add_argument("--compile", action="store_true", help="also compile ahead where JAX can without the device")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--max-prefill-chunk", type=int, default=512)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--expert-impl", default="auto", help="expert-FFN implementation (auto: the platform's)")
    p.add_argument(
        "--layer-preemption",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the layer-by-layer programs of pausable steps too (default: as serve, on without --mesh)",
    )
    p.add_argument(
        "--pause-every",
        type=int,
        default=1,
        metavar="LAYERS",
        help="layers between pause points (lowers the same programs: the layer count is traced)",
    )
    p.set_defaults(func=cmd_lower)


def cmd_lower(args: argparse.Namespace) -> int:
    from jaxmoe.engine.config import EngineConfig

    platforms = tuple(p.strip() for p in (args.platforms or "cuda,tpu").split(",") if p.strip())
    if not platforms:
        raise ValueError("--platforms: give at least one platform")
    config = EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_batch_tokens=args.max_batch_tokens,
        max_model_len=args.max_model_len,
        max_prefill_chunk=args.max_prefill_chunk,
        expert_impl=args.expert_impl,
        pause_every=args.pause_every,
    )
    log = None if args.json else (lambda line: print(line, flush=True))
    report = lower_all(
        args.model,
        args.mesh,
        platforms,
        args.dtype,
        config,
        args.compile,
        log=log,
        layer_preemption=args.layer_preemption,
    )
    if args.json:
        print(json.dumps(report))
    else:
        for platform, note in report["notes"].items():
            print(f"{platform}: {note}")
        failed = sum(not r["ok"] for r in report["programs"])
        print(f"{len(report['programs']) - failed} ok, {failed} failed")
    sys.stdout.flush()
    return 0 if report["ok"] else 1
