"""Live re-scaling of the disaggregated executor (JANUS 3.4 resource scaling): a new layout with
another number of attention and expert instances on the same devices, built from the running one.

* ``rescaled_spec``: the new ``ClusterSpec`` (attention instances on the lowest device indices,
  expert instances on the next ones, each as many devices as before -- tensor-parallel instances
  stay k devices; the other devices idle).
* ``reuse_placement``: the new slot -> expert table, keeping every expert a device already holds
  where it is (so its weights are not copied), then giving the experts nobody holds a slot, then
  redundant replicas in the spare slots.
* ``reshard_experts``: the new slot arrays, one device at a time: a slot whose expert is already on
  that instance's devices is a local slice; only the others are copied (one ``jax.device_put`` of
  one expert's weights -- with tensor parallelism, of the column slice device t of the instance
  holds, from device t of an instance that has it -- or, across processes and one device per
  expert instance, ``slot_moves`` ppermute rounds).
* ``build_rescaled``: the new ``DisaggregatedExecutor`` from the running one's parameters (attention
  side: one ``device_put`` to the new attention mesh; expert side: ``reshard_experts``).
* ``move_kv``: copies the KV blocks of live sequences from the old cache to their new blocks in the
  new executor's cache (through host memory: the old cache is read, the moved blocks written; when
  the old and new attention devices span processes, a ``slot_moves`` collective whose rows are
  cache slots, in a round structure fixed by the two layouts so that ``lower_kv_move`` compiles it
  before the swap).

Under ``jax.distributed`` (``check_processes``): either side may span processes when its instances
are one device each. The expert re-shard, the attention parameters onto new attention devices and
the KV move then run as ``slot_moves`` collectives: every process calls ``build_rescaled`` and
``move_kv`` at the same point.

The engine side (background build and compile, the swap at a step boundary, the stall) is
``jaxmoe.janus.live_rescale``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmoe.mesh import ClusterSpec, Instances, MeshConfigError, SubMeshes
from jaxmoe.models.routing import slots_with_extra
from jaxmoe.runtime import expert_program, slot_moves
from jaxmoe.runtime.attention_tp import AttentionTP
from jaxmoe.runtime.replicas import ReplicaLayout
from jaxmoe.runtime.process_local import ProcessLocal

RESCALED = " rescaled to "  # what rescaled_spec appends to a spec's source

_SLOT_KEYS = ("w_gate", "w_up", "w_down")


def rescaled_spec(
    spec: ClusterSpec, attention: int, experts: int, slots_per_instance: int | None = None
) -> ClusterSpec:
    """The layout with ``attention`` attention and ``experts`` expert instances on ``spec``'s devices,
    each instance as many devices as in ``spec`` (``devices_per_instance`` of its side, k_a and k_e:
    tensor-parallel instances stay tensor parallel): attention instance i on device indices
    i*k_a .. i*k_a + k_a - 1, expert instances on the next ones, the rest idle. ``slots_per_instance``:
    expert slots per instance (default: ``spec``'s). Raises ``MeshConfigError`` naming the value that
    does not fit."""
    for name, value in (("attention", attention), ("experts", experts)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MeshConfigError(f"{name} must be a positive integer (instances), got {value!r}")
    C = spec.experts.slots_per_instance if slots_per_instance is None else slots_per_instance
    if not isinstance(C, int) or isinstance(C, bool) or C < 1:
        raise MeshConfigError(f"slots_per_instance must be a positive integer, got {C!r}")
    if spec.shared_experts != "attention":
        raise MeshConfigError(
            f"{spec.source}: shared_experts: live re-scaling needs shared experts on the attention side"
        )
    ka, ke = spec.attention.devices_per_instance, spec.experts.devices_per_instance
    need = attention * ka + experts * ke
    if need > spec.num_devices:
        if ka == ke == 1:
            what = f"attention={attention} + experts={experts} = {need} instances"
        else:
            what = (
                f"attention={attention} x {ka} devices per instance + experts={experts} x {ke} devices per "
                f"instance = {need} devices"
            )
        raise MeshConfigError(f"{what} do not fit the {spec.num_devices} devices of {spec.source}")

    def group(first: int, count: int, k: int) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(range(first + i * k, first + (i + 1) * k)) for i in range(count))

    return dataclasses.replace(
        spec,
        attention=Instances(group(0, attention, ka)),
        experts=Instances(group(attention * ka, experts, ke), C),
        # the file's name and the layout, not a chain of every earlier rescale: a layout seen before
        # must be the same (hashable) spec again, so it finds its cached meshes and programs
        source=f"{spec.source.split(RESCALED)[0]}{RESCALED}{attention}a{experts}e",
    )


def reuse_placement(old: ReplicaLayout, old_spec: ClusterSpec, new_spec: ClusterSpec) -> list[int]:
    """slot -> expert of the new layout that keeps as many (instance devices, expert) pairs as possible
    (an instance keeps an expert when the same devices, in the same order, held it before: with
    tensor parallelism each device holds the same slice of the expert's FFN columns again)."""
    E, C = old.num_experts, new_spec.experts.slots_per_instance
    held: dict[tuple[int, ...], list[int]] = {inst: [] for inst in old_spec.experts.devices}
    for s, e in enumerate(old.slot_to_expert):
        inst = old_spec.experts.devices[s // old.slots_per_instance]
        if e >= 0 and e not in held[inst]:
            held[inst].append(e)
    N = new_spec.experts.count
    slots = [list(held.get(inst, []))[:C] for inst in new_spec.experts.devices]
    reps = np.bincount([e for inst in slots for e in inst], minlength=E)
    for e in [e for e in range(E) if reps[e] == 0]:  # experts no kept device holds
        j = max(range(N), key=lambda j: (C - len(slots[j]), -j))
        if len(slots[j]) == C:  # full: replace the copy of the most replicated expert
            j, k = max(((j, k) for j in range(N) for k in range(C)), key=lambda jk: reps[slots[jk[0]][jk[1]]])
            reps[slots[j][k]] -= 1
            slots[j][k] = e
        else:
            slots[j].append(e)
        reps[e] += 1
    for j in range(N):  # spare slots: replicas of the least replicated experts not on the instance
        while len(slots[j]) < C:
            free = [e for e in range(E) if e not in slots[j]]
            if not free:
                slots[j].append(-1)
                continue
            e = min(free, key=lambda e: (reps[e], e))
            slots[j].append(e)
            reps[e] += 1
    return [e for inst in slots for e in inst]


@dataclasses.dataclass
class MoveStats:
    """What a re-layout copied: expert slots kept on their device (local slices), copied from
    another device (with their bytes), and KV blocks moved."""

    expert_slots_local: int = 0
    expert_slots_copied: int = 0
    expert_bytes_copied: int = 0
    kv_blocks_moved: int = 0
    kv_bytes_moved: int = 0  # KV of the moved blocks that changed device (every layer)


def reshard_experts(
    placed: dict,
    old: ReplicaLayout,
    old_sub: SubMeshes,
    new: ReplicaLayout,
    new_sub: SubMeshes,
    stats: MoveStats,
    collective: bool | None = None,
) -> dict:
    """One MoE layer's expert-side parameters (as ``expert_program.place_layer`` lays them out) moved
    from layout ``old`` on ``old_sub`` to ``new`` on ``new_sub``: the router and other replicated
    arrays go to the new expert mesh; a slot array's new slot is a slice of the same device's old
    shard when that device held the expert, else a copy from a device that does (preferring one on
    the same node).

    Two ways to copy, with the same result: ``jax.device_put`` (one expert's weights per copy) when
    this process addresses every device involved, and collectives (``slot_moves.SlotMover``:
    ppermute rounds carrying only the copied slots, and the replicated arrays to the new expert
    devices that lack them; every process calls it) when the old and new expert devices span
    processes. ``collective``: force one way (None: pick as just said)."""
    C_old, C = old.slots_per_instance, new.slots_per_instance
    spec = new_sub.spec
    old_insts, new_insts = old_sub.spec.experts.devices, spec.experts.devices  # spec device indices
    old_idx = [inst[0] for inst in old_insts]  # the first device of each old instance
    new_idx = [inst[0] for inst in new_insts]
    involved = sorted(set(old_sub.spec.experts.flat) | set(spec.experts.flat))
    tp = spec.experts.devices_per_instance > 1
    if collective is None:
        collective = len({new_sub.devices[d].process_index for d in involved}) > 1
    if collective and tp:
        raise MeshConfigError(
            f"{spec.source}: experts.devices_per_instance: {spec.experts.devices_per_instance} (FFN columns split) "
            "with the expert side spanning processes: collective slot moves carry whole slots only (not built)"
        )
    # per new slot: (old slot it comes from, or -1 for unused); remote copies spread over sources
    sources, sends = [], {}
    for s, e in enumerate(new.slot_to_expert):
        if e < 0:
            sources.append(-1)
            continue
        hosts = old.replicas(e)
        inst = new_insts[s // C]
        same_inst = [h for h in hosts if old_insts[h // C_old] == inst]
        if same_inst:
            sources.append(same_inst[0])
            continue
        same_node = [h for h in hosts if spec.node_of(old_idx[h // C_old]) == spec.node_of(inst[0])]
        src = min(same_node or hosts, key=lambda h: sends.get(h // C_old, 0))
        sends[src // C_old] = sends.get(src // C_old, 0) + 1
        sources.append(src)
    slot_bytes = {k: placed[k].nbytes // placed[k].shape[0] for k in _SLOT_KEYS}
    for s, src in enumerate(sources):
        if src < 0:
            continue
        if old_insts[src // C_old] == new_insts[s // C]:
            stats.expert_slots_local += 1
        else:
            stats.expert_slots_copied += 1
            stats.expert_bytes_copied += sum(slot_bytes.values())
    if collective:
        return _reshard_collective(placed, sources, old_idx, new_idx, C_old, C, new_sub)
    rep = NamedSharding(new_sub.experts, P())
    out = {k: jax.device_put(v, rep) for k, v in placed.items() if k not in _SLOT_KEYS}
    arrays = {}
    for name, arr in expert_program.slot_arrays(placed).items():  # a quantized weight's scales move with it
        sharding = NamedSharding(new_sub.experts, expert_program.slot_spec(name, tp, arr.shape))
        shards = {sh.device: sh.data for sh in arr.addressable_shards}
        local = arr.sharding.shard_shape(arr.shape)[1:]  # one slot on one device (its columns: expert_tp)
        per_device = []
        for j, inst in enumerate(new_insts):
            for t, d in enumerate(inst):  # device t of the instance gets column slice t of each slot
                dev = new_sub.devices[d]
                pieces = []
                for s in range(j * C, (j + 1) * C):
                    src = sources[s]
                    if src < 0:
                        pieces.append(jax.device_put(np.zeros((1,) + local, arr.dtype), dev))
                        continue
                    src_dev = new_sub.devices[old_insts[src // C_old][t]]
                    piece = shards[src_dev][src % C_old : src % C_old + 1]
                    pieces.append(piece if src_dev == dev else jax.device_put(piece, dev))
                per_device.append(jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0])
        shape = (new.num_slots,) + arr.shape[1:]
        arrays[name] = jax.make_array_from_single_device_arrays(shape, sharding, per_device, dtype=arr.dtype)
    return expert_program.with_slot_arrays({**placed, **out}, arrays)


def _reshard_collective(placed, sources, old_idx, new_idx, C_old, C, new_sub) -> dict:
    """``reshard_experts`` with ``slot_moves`` collectives (one device per instance on both sides)."""
    mover = slot_moves.mover_for(new_sub)
    involved = tuple(sorted(set(old_idx) | set(new_idx)))
    keep: dict[int, tuple[int, ...]] = {}
    copies = []
    for j, d in enumerate(new_idx):
        rows = []
        for c in range(C):
            src = sources[j * C + c]
            src_dev = old_idx[src // C_old] if src >= 0 else -1
            rows.append(src % C_old if src_dev == d else -1)
            if src >= 0 and src_dev != d:
                copies.append(slot_moves.RowCopy(src_dev, src % C_old, d, c))
        keep[d] = tuple(rows)
    plan = slot_moves.SlotPlan(involved, C_old, C, keep, tuple(copies))
    sharding = NamedSharding(new_sub.experts, P("expert"))
    out = expert_program.with_slot_arrays(
        placed, mover.run(plan, expert_program.slot_arrays(placed), sharding, len(new_idx) * C)
    )
    # replicated arrays (router, score bias): kept where an old expert device is a new one, else
    # all rows from an old expert device (the same node first, round robin)
    rep = NamedSharding(new_sub.experts, P())
    spec = new_sub.spec
    for k, v in placed.items():
        if k in _SLOT_KEYS:
            continue
        if v.ndim == 0:
            raise ValueError(f"reshard_experts: replicated parameter {k!r} is a scalar; expected at least one axis")
        rows = v.shape[0]
        keep, copies = {}, []
        for n, d in enumerate(new_idx):
            if d in old_idx:
                keep[d] = tuple(range(rows))
                continue
            near = [o for o in old_idx if spec.node_of(o) == spec.node_of(d)] or old_idx
            src = near[n % len(near)]
            keep[d] = (-1,) * rows
            copies += [slot_moves.RowCopy(src, r, d, r) for r in range(rows)]
        plan = slot_moves.SlotPlan(involved, rows, rows, keep, tuple(copies))
        out[k] = mover.run(plan, {k: v}, rep, rows)[k]
    return out


def check_processes(old_sub: SubMeshes, spec: ClusterSpec, extra_experts: bool) -> None:
    """Under ``jax.distributed``: what live re-scaling from ``old_sub`` to layout ``spec`` (same
    devices) cannot do across processes yet raises ``MeshConfigError``. Either side may span
    processes when its instances are one device each (``slot_moves`` collectives: expert slots,
    attention parameters and KV blocks move as whole rows); the routing's extra logical experts
    (``extra_experts``: e.g. brownout's united experts) are placed again from host weights, so not
    with an expert side spanning processes."""
    devices = old_sub.devices
    old_attn = {d.process_index for d in old_sub.attention.devices.flat}
    attention = old_attn | {devices[d].process_index for d in spec.attention.flat}
    k = max(spec.attention.devices_per_instance, old_sub.spec.attention.devices_per_instance)
    if k > 1 and len(attention) > 1:
        raise MeshConfigError(
            f"{spec.source}: attention.devices_per_instance: {k} (heads split) with the attention side on "
            f"processes {sorted(attention)}: collective KV moves carry whole slots only (not built)"
        )
    old_exp = {d.process_index for d in old_sub.experts.devices.flat}
    experts = old_exp | {devices[d].process_index for d in spec.experts.flat}
    k = spec.experts.devices_per_instance
    if k > 1 and len(experts) > 1:
        raise MeshConfigError(
            f"{spec.source}: experts.devices_per_instance: {k} (FFN columns split) with the expert side on "
            f"processes {sorted(experts)}: collective slot moves carry whole slots only (not built)"
        )
    if extra_experts and len(experts) > 1:
        raise MeshConfigError(
            f"{spec.source}: live re-scaling with extra experts (brownout) places them from host "
            f"weights, which an expert side on processes {sorted(experts)} does not have"
        )


def _attention_spans_processes(old_sub: SubMeshes, new_sub: SubMeshes) -> bool:
    """Whether the old and new attention devices together belong to more than one process."""
    devs = list(old_sub.attention.devices.flat) + list(new_sub.attention.devices.flat)
    return len({d.process_index for d in devs}) > 1


def build_rescaled(old, spec: ClusterSpec, num_slots: int, collective: bool | None = None, **executor_kwargs):
    """A ``DisaggregatedExecutor`` on layout ``spec`` built from the running executor ``old`` (read
    only: ``old`` keeps serving meanwhile). Returns (executor, MoveStats of the expert re-shard).
    ``collective``: force the attention parameters' way to the new attention devices (None: collectives
    when the old and new attention devices span processes, else ``jax.device_put``)."""
    from jaxmoe.runtime.disaggregated import DisaggregatedExecutor, _sub_meshes

    sub = _sub_meshes(spec)  # cached by spec: a layout seen before reuses its meshes and programs
    side = old.expert_side
    check_processes(old.sub, spec, side.num_extra > 0)
    layouts, layers = dict(side.layouts), dict(side.layers)  # one snapshot (set_placement replaces both)
    first = side.moe_layers[0]
    target = spec
    if side.num_extra:  # the routing's extra experts take ceil(U / N) more slots per instance on the new layout
        C = slots_with_extra(spec.experts.slots_per_instance, side.num_extra, spec.experts.count)
        target = dataclasses.replace(spec, experts=Instances(spec.experts.devices, C))
    placement = [reuse_placement(layouts[i], old.sub.spec, target) for i in side.moe_layers]
    new_layouts = {
        i: ReplicaLayout(tuple(p), layouts[first].num_experts, spec.experts.count, target.experts.slots_per_instance)
        for i, p in zip(side.moe_layers, placement)
    }
    stats = MoveStats()
    placed = {i: reshard_experts(layers[i], layouts[i], old.sub, new_layouts[i], sub, stats) for i in side.moe_layers}
    attn = NamedSharding(sub.attention, P())  # the new attention side
    tp = old.attention.tp  # the same devices per attention instance on the new layout: the same split
    params = {k: v for k, v in old.params.items() if k != "layers"}
    params["layers"] = [
        {k: (v if k == "moe" else _logical_kv(v, tp) if k == "attn" else v) for k, v in layer.items()}
        for layer in old.params["layers"]
    ]
    attention_side = {k: v for k, v in params.items() if k != "layers"}
    attention_side["layers"] = [{k: v for k, v in layer.items() if k != "moe"} for layer in params["layers"]]
    if collective is None:
        collective = _attention_spans_processes(old.sub, sub)
    if collective:  # one device per attention instance (check_processes)
        moved = _onto_collective(attention_side, old.sub, sub)
    else:
        moved = _onto(attention_side, attn)
    for layer, new_layer in zip(params["layers"], moved["layers"]):
        layer.update(new_layer)
    params.update({k: v for k, v in moved.items() if k != "layers"})
    ex = DisaggregatedExecutor(
        old.cfg,
        params,
        num_slots,
        old.block_size,
        sub,
        placement=placement,
        placed_experts=placed,
        routing=side.routing,
        routing_state=side.routing_state,
        expert_impl=old.expert_impl,
        pause_every=old.pause_every,
        expert_rounds=old.expert_rounds,  # QLLM's per-expert queues, if on
        pipeline=old.pipeline,
        cache_dtype=jax.tree.leaves(old.cache)[0].dtype,
        **executor_kwargs,
    )
    ex.timing = old.timing
    ex.routing_state = old.routing_state  # it may have moved meanwhile (e.g. SALC's threshold)
    return ex, stats


def _logical_kv(attn: dict, tp: AttentionTP) -> dict:
    """A layer's attention parameters as the model has them: with tensor parallelism over more devices
    than GQA KV heads the running executor holds every KV head repeated ``tp.kv_repeat`` times
    (``attention_tp.expand_kv``), which the new executor's ``place_layer`` repeats again, so the
    copies are dropped first (heads j*repeat .. j*repeat + repeat - 1 are the same head j)."""
    if tp.kv_repeat == 1:
        return attn
    hd, out = tp.cfg.attn.head_dim, dict(attn)
    for name in ("k", "v", "k_bias", "v_bias"):
        if name in attn:
            w = attn[name]
            heads = w.reshape(w.shape[:-1] + (-1, hd))[..., :: tp.kv_repeat, :]
            out[name] = heads.reshape(w.shape[:-1] + (-1,))
    return out


def _onto(tree, sharding: NamedSharding):
    """Attention-side parameters moved to the new attention mesh: ``jax.device_put`` in the process
    that holds both meshes; a process holding neither (under ``jax.distributed``) only builds the
    arrays' metadata (jax refuses a ``device_put`` it takes no part in)."""
    mine = jax.process_index()
    here = any(d.process_index == mine for d in sharding.device_set)

    def one(x):
        if here or x.addressable_shards:
            return jax.device_put(x, sharding)
        return jax.make_array_from_single_device_arrays(x.shape, sharding, [], dtype=x.dtype)

    return jax.tree.map(one, tree)


def _onto_collective(tree, old_sub: SubMeshes, new_sub: SubMeshes):
    """Attention-side parameters (replicated on every attention device, one device per instance)
    moved to the new attention mesh when the old and new attention devices span processes: one
    ``slot_moves`` program for every leaf (each device's copy seen as one row ``[1, size]``); a new
    attention device that was an old one keeps its copy, the others receive one from an old
    attention device (the same process first). Every process calls it together."""
    spec = new_sub.spec
    old_idx = [inst[0] for inst in old_sub.spec.attention.devices]
    new_idx = [inst[0] for inst in spec.attention.devices]
    devices = new_sub.devices
    keep, copies = {}, []
    for n, d in enumerate(new_idx):
        if d in old_idx:
            keep[d] = (0,)
            continue
        near = [o for o in old_idx if devices[o].process_index == devices[d].process_index] or old_idx
        keep[d] = (-1,)
        copies.append(slot_moves.RowCopy(near[n % len(near)], 0, d, 0))
    plan = slot_moves.SlotPlan(tuple(sorted(set(old_idx) | set(new_idx))), 1, 1, keep, tuple(copies))
    leaves, treedef = jax.tree.flatten(tree)
    for i, leaf in enumerate(leaves):
        if not leaf.sharding.is_fully_replicated:
            raise ValueError(f"attention parameter {i} is not replicated on the attention devices: {leaf.sharding}")
    rows = _as_rows(old_sub.attention)(leaves)  # each device's copy as its row of [instances, size]
    new_rows = NamedSharding(new_sub.attention, P("attn"))
    out = slot_moves.mover_for(new_sub).run(
        plan, {f"{i:05d}": r for i, r in enumerate(rows)}, new_rows, spec.attention.count
    )
    shapes = tuple(leaf.shape for leaf in leaves)
    moved = _from_rows(new_sub.attention, shapes)([out[f"{i:05d}"] for i in range(len(leaves))])
    return jax.tree.unflatten(treedef, moved)


@functools.lru_cache(maxsize=16)
def _as_rows(mesh):
    """Replicated arrays on ``mesh`` -> [instances, size] arrays P("attn") whose row j is instance
    j's copy (a local reshape on each device: no communication)."""
    return ProcessLocal(
        jax.jit(
            jax.shard_map(
                lambda xs: [x.reshape(1, -1) for x in xs], mesh=mesh, in_specs=P(), out_specs=P("attn"), check_vma=False
            )
        ),
        mesh,
        NamedSharding(mesh, P("attn")),
    )


@functools.lru_cache(maxsize=16)
def _from_rows(mesh, shapes: tuple):
    """``_as_rows`` undone: [instances, size] P("attn") arrays whose rows are the same copy ->
    arrays of ``shapes`` replicated on ``mesh`` (each device reshapes its own row)."""
    return ProcessLocal(
        jax.jit(
            jax.shard_map(
                lambda xs: [x.reshape(shape) for x, shape in zip(xs, shapes)],
                mesh=mesh,
                in_specs=P("attn"),
                out_specs=P(),
                check_vma=False,
            )
        ),
        mesh,
        NamedSharding(mesh, P()),
    )


def move_kv(
    old, new, moves: list[tuple[list[int], list[int]]], stats: MoveStats, collective: bool | None = None
) -> None:
    """Copy the KV of blocks ``old_blocks`` of executor ``old``'s cache into blocks ``new_blocks`` of
    ``new``'s cache, for each (old_blocks, new_blocks) of ``moves``; the other blocks of the new cache
    are zeros. In one process (or with the old and new attention side inside one) through host
    memory: every layer's old cache is read once; across processes with ``slot_moves`` collectives
    (``_move_kv_collective``: only the slots that change device travel, every process calls it).
    ``collective``: force one way (None: collectives when the attention devices span processes)."""
    if collective is None:
        collective = _attention_spans_processes(old.sub, new.sub)
    if collective:
        _move_kv_collective(old, new, moves, stats)
        return
    bs = old.block_size
    src = np.concatenate([np.asarray(o, np.int64) for o, _ in moves] or [np.zeros(0, np.int64)])
    dst = np.concatenate([np.asarray(n, np.int64) for _, n in moves] or [np.zeros(0, np.int64)])
    src_slots = (src[:, None] * bs + np.arange(bs)).reshape(-1)
    dst_slots = (dst[:, None] * bs + np.arange(bs)).reshape(-1)
    stats.kv_blocks_moved += len(src)
    old_inst, new_inst = old.kv_layout.instance_of_block(src), new.kv_layout.instance_of_block(dst)
    old_dev = np.array([inst[0] for inst in old.sub.spec.attention.devices])[old_inst]
    new_dev = np.array([inst[0] for inst in new.sub.spec.attention.devices])[new_inst]
    stats.kv_bytes_moved += int(np.sum(old_dev != new_dev)) * bs * _bytes_per_slot(new.cache)
    cache = []
    for old_layer, new_layer in zip(old.cache, new.cache):
        layer = {}
        for key, leaf in old_layer.items():
            target = new_layer[key]
            host = np.zeros(target.shape, target.dtype)
            # under jax.distributed a process without attention devices holds no shard (and gets none)
            if len(src_slots) and leaf.is_fully_addressable and leaf.addressable_shards:
                host[dst_slots] = np.asarray(leaf)[src_slots]
            layer[key] = jax.device_put(host, target.sharding)
        cache.append(layer)
    new.cache = cache


def _bytes_per_slot(cache: list[dict]) -> int:
    """KV bytes of one token slot over every layer of ``cache``."""
    return sum(leaf.nbytes // leaf.shape[0] for layer in cache for leaf in layer.values())


def _kv_rounds(old, new) -> slot_moves.FixedRounds:
    """The KV move's round structure, known before the moves are: every old attention device to
    every other new one, a pair's slots padded to a bucket (``block_size`` x 4^i slots, up to an
    instance's)."""
    old_idx = [inst[0] for inst in old.sub.spec.attention.devices]
    new_idx = [inst[0] for inst in new.sub.spec.attention.devices]
    old_rows, new_rows = old.kv_layout.slots_per_instance, new.kv_layout.slots_per_instance
    return slot_moves.FixedRounds.between(old_idx, new_idx, old_rows, new_rows, old.block_size)


def lower_kv_move(old, new, collective: bool | None = None) -> list:
    """The programs ``move_kv(old, new, ...)`` runs when the attention devices span processes (one
    per bucket of ``_kv_rounds``), lowered but not compiled (nothing runs, no collective); compiling
    them (``.compile()``) before the swap leaves the swap nothing to compile. Empty when ``move_kv``
    goes through host memory. ``collective``: as ``move_kv``'s."""
    if not (_attention_spans_processes(old.sub, new.sub) if collective is None else collective):
        return []
    leaves = {
        f"{i:05d}/{k}": (leaf.shape, leaf.dtype) for i, layer in enumerate(old.cache) for k, leaf in layer.items()
    }
    return slot_moves.mover_for(new.sub).lower(_kv_rounds(old, new), leaves)


def _move_kv_collective(old, new, moves: list[tuple[list[int], list[int]]], stats: MoveStats) -> None:
    """``move_kv`` when the old and new attention devices span processes (one device per attention
    instance: ``check_processes``): one ``slot_moves.SlotPlan`` over the old and new attention
    devices whose rows are cache slots (a block that stays on its device is kept, one ``RowCopy``
    per slot of a block that changes device), run by one program over every layer's cache leaves,
    in the fixed rounds of ``_kv_rounds`` (so ``lower_kv_move`` can compile it ahead)."""
    bs = old.block_size
    old_layout, new_layout = old.kv_layout, new.kv_layout
    old_idx = [inst[0] for inst in old.sub.spec.attention.devices]
    new_idx = [inst[0] for inst in new.sub.spec.attention.devices]
    old_rows, new_rows = old_layout.slots_per_instance, new_layout.slots_per_instance
    keep = {d: [-1] * new_rows for d in new_idx}
    copies = []
    blocks = moved = 0
    for old_blocks, new_blocks in moves:
        for ob, nb in zip(old_blocks, new_blocks):
            blocks += 1
            src = old_idx[old_layout.instance_of_block(ob)]
            dst = new_idx[new_layout.instance_of_block(nb)]
            src_row = (ob - old_layout.first_block(old_layout.instance_of_block(ob))) * bs
            dst_row = (nb - new_layout.first_block(new_layout.instance_of_block(nb))) * bs
            if src == dst:
                keep[dst][dst_row : dst_row + bs] = range(src_row, src_row + bs)
            else:
                moved += 1
                copies += [slot_moves.RowCopy(src, src_row + i, dst, dst_row + i) for i in range(bs)]
    plan = slot_moves.SlotPlan(
        tuple(sorted(set(old_idx) | set(new_idx))),
        old_rows,
        new_rows,
        {d: tuple(rows) for d, rows in keep.items()},
        tuple(copies),
    )
    leaves = {f"{i:05d}/{k}": leaf for i, layer in enumerate(old.cache) for k, leaf in layer.items()}
    sharding = {f"{i:05d}/{k}": leaf.sharding for i, layer in enumerate(new.cache) for k, leaf in layer.items()}
    first = next(iter(sharding.values()))
    if any(s != first for s in sharding.values()):
        raise ValueError("move_kv: the new cache's layers are not sharded alike")
    out = slot_moves.mover_for(new.sub).run(plan, leaves, first, new_layout.num_slots, fixed=_kv_rounds(old, new))
    new.cache = [{k: out[f"{i:05d}/{k}"] for k in layer} for i, layer in enumerate(new.cache)]
    stats.kv_blocks_moved += blocks
    stats.kv_bytes_moved += moved * bs * _bytes_per_slot(new.cache)
