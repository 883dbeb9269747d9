"""The expert side of the disaggregated runtime: one jitted program on the expert sub-mesh.

Per MoE layer, every expert instance j (a ``shard_map`` over mesh axis "expert") gets the full
post-attention activations xn [B, T, D] (replicated by A2E: JANUS sends activations, not routing
metadata) and runs

  1. gate       the executor's ``ExpertRouting.route`` (``models.routing``; top-k by default):
                logical expert ids [B*T, K'] and combine weights (padding tokens, valid == False,
                get id -1: they activate no expert);
  2. AEBS       ``jaxmoe.pallas_kernels.aebs.api.schedule``: logical id -> physical replica slot.
                Inputs are identical on every instance and the policy is deterministic, so
                every instance computes the same assignment with no synchronisation;
  3. experts    ``jaxmoe.pallas_kernels.expert_ffn`` over the C slots it hosts
                (slot ids outside j*C .. j*C+C-1 masked to -1: "not mine");
  4. shared     (only when the mesh file says ``shared_experts: experts``) the shared experts
                split over instances along their hidden width, each adding its slice;

and returns partial[None] [1, B, T, D] -> [N, B, T, D] sharded P("expert"); E2A sums the
partials into the attention side. The program also adds this step's co-activation counts
(tokens per pair of logical experts, the diagonal: tokens per expert) to a replicated on-device
[E', E'] counter (E' = E + U logical experts: the originals and the routing's extra experts, e.g.
BrownoutServe's united experts, as routed), the statistics of the placement controller, and
returns the activated replicas per instance and the distinct (original, extra) experts used.

With QLLM's per-expert queues (``DisaggregatedExecutor(expert_rounds=...)``) the same work runs as
programs of its own: ``route`` (the gate and the counters: every assignment's logical expert, the
queues) and ``serve`` (one round: AEBS and the grouped matmul over the queued assignments of a range
of logical experts, which then leave their queues), so a best-effort step can pause between them.

In deterministic mode (the ``cpu_kernel_invariant`` expert-FFN form) a token's output does not depend
on the batch or on where AEBS placed its experts: the router runs through the invariant matmul kernel,
each (token, choice) assignment runs through the expert kernel as a row of its own, the rows are summed
over the instances (one of them computed each; the others add exact zeros) and a token's choices added
in their order; instance 0 returns the result, the others zeros (``assignments_combined``).

Weights: the logical experts (``ExpertRouting.logical_params``) as slot arrays [S, D, F] / [S, F, D]
sharded P("expert") (S = N x C, see ``jaxmoe.runtime.replicas``); router (and DeepSeek-V3 score bias,
and what else the routing reads) replicated; shared experts (expert side only) sharded on their
hidden axis. int8 / fp8 weights (``jaxmoe.quantization``) stay quantized in their slots, values and
scales side by side (``slot_arrays``: they move together), int8 values as column panels where the
instance is one device; the expert FFN dequantizes one expert at a time (the CPU kernel reads int8
in place).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmoe.config import ModelConfig
from jaxmoe.mesh import EXPERT_AXES, MeshConfigError, SubMeshes
from jaxmoe.models.experts import shared_experts
from jaxmoe.models.layer_matrix import invariant_matrices
from jaxmoe.models.experts import TOP_K
from jaxmoe.models.routing import WEIGHTS, ExpertRouting
from jaxmoe.runtime import slot_moves
from jaxmoe.runtime.process_local import ProcessLocal
from jaxmoe.runtime.replicas import ReplicaLayout
from jaxmoe.pallas_kernels.aebs.api import POLICIES, resolve_impl, schedule
from jaxmoe.pallas_kernels.expert_ffn import Stacked, expert_ffn, fallback_above, resolve
from jaxmoe.pallas_kernels.expert_ffn.cpu_kernel import program_jit
from jaxmoe.pallas_kernels.expert_ffn.panels import Panels, to_panels, width_for
from jaxmoe.quantization import Quantized, is_quantized

EXP, ETP = EXPERT_AXES
_SLOT_SPEC = P(EXP)
SLOT_WEIGHTS = ("w_gate", "w_up", "w_down")
# expert_tp > 1 (experts.devices_per_instance): each device of an instance holds a slice of every
# slot's FFN columns (w_gate / w_up: hidden columns, w_down: the matching rows); the partial outputs
# are summed over the instance's devices.
_TP_SLOT_SPECS = {"w_gate": P(EXP, None, ETP), "w_up": P(EXP, None, ETP), "w_down": P(EXP, ETP, None)}
_SHARED_SPECS = {"w_gate": P(None, EXP), "w_up": P(None, EXP), "w_down": P(EXP, None)}
# "auto": the fastest expert-FFN form over replica slots on this backend. On CPU the C++ kernel over
# the plain slot arrays (bucketed_loop for prefill-sized batches; padded_einsum, the default before
# it, took 1.5-2.8x its expert time per layer, BENCHMARKS.md); padded_einsum, where named, runs with
# capacity B*T rows per slot, which is exact: a token selects an expert at most once and AEBS sends
# all of an expert's tokens to one replica, so no slot gets more.
AUTO_EXPERT_IMPL = {"cpu": "cpu_kernel", "other": "ragged_dot"}


def slot_spec(name: str, tp: bool = False, shape: tuple = ()) -> P:
    """PartitionSpec of a routed-expert slot array (``w_gate`` / ``w_up`` / ``w_down``, or a quantized
    weight's ``.q`` / ``.scale``, ``slot_arrays``). A scale is split as its weight, but for its axes of
    size 1 (``shape``: int8's one row of per-column scales), which every device holds whole."""
    spec = _TP_SLOT_SPECS[weight_name(name)] if tp else _SLOT_SPEC
    if name == f"{weight_name(name)}.scale":
        spec = P(*(None if i and n == 1 else axis for i, (axis, n) in enumerate(zip(spec, shape))))
    return spec


def check_tp(cfg: ModelConfig, spec) -> bool:
    """Whether ``spec``'s expert instances split the FFN columns (devices_per_instance > 1); raises
    ``MeshConfigError`` naming the field when they do not divide the experts' intermediate size."""
    k, F = spec.experts.devices_per_instance, cfg.moe.intermediate_size
    if k > 1 and F % k:
        raise MeshConfigError(
            f"{spec.source}: experts.devices_per_instance: {k} devices per instance must divide the "
            f"experts' intermediate size {F} (tensor parallelism splits the FFN columns)"
        )
    return k > 1


def param_specs(moe: dict, tp: bool = False) -> dict:
    """PartitionSpecs of one layer's expert-side parameters (as laid out by ``place_layer``);
    ``tp``: FFN columns split over each instance's devices (``expert_tp``)."""
    specs = {k: P() for k in moe if k not in ("shared", *SLOT_WEIGHTS)}
    for k in SLOT_WEIGHTS:
        w = moe[k]
        specs[k] = (
            Quantized(slot_spec(f"{k}.q", tp), slot_spec(f"{k}.scale", tp, w.scale.shape), w.block)
            if is_quantized(w)
            else slot_spec(k, tp)
        )
    if "shared" in moe:
        specs["shared"] = {k: _SHARED_SPECS.get(k, P()) for k in moe["shared"]}
    return specs


def _shardings(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


@dataclasses.dataclass(frozen=True)
class ExpertProgram:
    run: Callable  # (params, tables, x, valid, step, coact, routing_state) -> (partials, coact, activated, used)
    replicated: NamedSharding  # P() on the expert mesh
    # per-expert queues (QLLM), the gate and the experts as programs of their own:
    route: Callable | None = None  # (params, x, valid, coact, routing_state) -> (queued ids, weights, coact, used)
    # (params, tables, x, queued, weights, step, lo, hi) -> (partials, activated, queued): serve experts [lo, hi)
    serve: Callable | None = None
    fallback_above: int | None = None  # steps of more tokens run the FFN form's fallback (expert_ffn.fallback_above)
    aebs_impl: str = "reference"  # the AEBS form it runs (pallas_kernels.aebs.resolve_impl)


@functools.lru_cache(maxsize=32)
def make_expert_program(
    cfg: ModelConfig,
    sub: SubMeshes,
    slots_per_instance: int,
    *,
    policy: str = "aebs",
    aebs_impl: str = "auto",
    expert_impl: str = "auto",
    interpret: bool | None = None,
    routing: ExpertRouting = TOP_K,
) -> ExpertProgram:
    """The jitted expert program (cached like ``make_attention_programs``). ``routing``: the MoE
    layers' expert routing (the slot arrays hold its E + U logical experts, the tables cover them;
    its state is the program's traced ``routing_state`` argument)."""
    N, C, E = sub.spec.experts.count, slots_per_instance, cfg.moe.num_experts
    if policy not in POLICIES:  # the executor's replica_policy
        raise ValueError(f"replica_policy must be one of {POLICIES} (AEBS or random scheduling), got {policy!r}")
    tp = check_tp(cfg, sub.spec)
    ffn_impl = resolve(expert_impl, AUTO_EXPERT_IMPL)
    invariant = ffn_impl == "cpu_kernel_invariant"  # deterministic mode (``assignments_combined``)
    aebs_impl = resolve_impl(aebs_impl, policy)  # "auto": the platform's form (pallas_kernels.aebs.AUTO_IMPL)

    def counters(ids, L):
        """Co-activation counts [L, L] (tokens that chose both e and f; diagonal: e) and the distinct
        original / extra experts used, of one call's logical ids."""
        hit = jax.nn.one_hot(ids, L, dtype=jnp.float32).sum(1)  # [B*T, L]: 1 where the token chose e
        coact = jnp.round(jnp.matmul(hit.T, hit, precision="highest")).astype(jnp.int32)

        def distinct(mask):
            return jnp.zeros((L,), bool).at[jnp.where(mask, ids, L)].set(True, mode="drop").sum()

        used = jnp.stack([distinct((ids >= 0) & (ids < E)), distinct(ids >= E)]).astype(jnp.int32)
        return coact, used

    def assignments_combined(p, x2, local, weights):
        """Deterministic mode: the routed output [B*T, D] (float32, the same on every instance) summed
        in one order whatever the batch and wherever AEBS placed each assignment: every (token, k)
        assignment's weighted output by the kernel as a row of its own, gathered over the instances
        (each assignment runs on one replica, the others add exact zeros), then added up in k order."""
        T, K = local.shape
        y = expert_ffn(
            jnp.repeat(x2, K, axis=0),
            local.reshape(T * K, 1),
            weights.reshape(T * K, 1),
            Stacked(p["w_gate"], p["w_up"], p["w_down"]),
            impl=ffn_impl,
            interpret=interpret,
        )
        y = jax.lax.psum(y.astype(jnp.float32).reshape(T, K, -1), (EXP, ETP) if tp else EXP)
        out = y[:, 0]
        for k in range(1, K):
            out = out + y[:, k]
        return out

    def shared_part(p, x2):
        """This instance's slice of the shared experts' output; deterministic mode: the whole output
        (the slices summed over the instances, float32)."""
        if not invariant:
            return shared_experts(p["shared"], x2)
        return jax.lax.psum(shared_experts(invariant_matrices(p["shared"]), x2).astype(jnp.float32), EXP)

    def partial_out(y, x2, B, T):
        """[1, B, T, D] in x2's dtype: this instance's partial output; deterministic mode: the whole
        output on instance 0, zeros elsewhere (E2A's sum then adds only exact zeros to it)."""
        if invariant:
            y = jnp.where(jax.lax.axis_index(EXP) == 0, y, 0)
        return y.astype(x2.dtype).reshape(1, B, T, -1)

    def gate_params(p):
        """The parameters the gate reads; deterministic mode: the router as an invariant matrix."""
        return {**p, "router": invariant_matrices(p["router"])} if invariant else p

    def place_and_run(p, tables, x2, ids, weights, step):
        """AEBS (logical -> physical replica, identical on every instance), then the grouped matmul
        over the replicas this instance hosts: (its routed output [B*T, D], activated replicas)."""
        phys, activated = schedule(
            ids,
            tables["replica_table"],
            tables["replica_instance"],
            N,
            policy=policy,
            impl=aebs_impl,
            interpret=interpret,
            seed=step,
        )
        first = jax.lax.axis_index(EXP) * C
        local = jnp.where((phys >= first) & (phys < first + C), phys - first, -1)
        if invariant:
            return assignments_combined(p, x2, local, weights), activated
        y = expert_ffn(
            x2, local, weights, Stacked(p["w_gate"], p["w_up"], p["w_down"]), impl=ffn_impl, interpret=interpret
        )
        if tp:  # this device computed its slice of the FFN columns: sum the instance's slices
            y = jax.lax.psum(y, ETP)
        return y, activated

    def per_instance(p, tables, x, valid, step, state):
        B, T, D = x.shape
        x2 = x.reshape(B * T, D)
        L = tables["replica_table"].shape[0]  # logical experts: E originals + U extras
        # 1. gate (expert side): logical ids, what runs (the counters count it)
        ids, weights = routing.route(gate_params(p), cfg.moe, x2, valid.reshape(B * T), state)
        # 2.-3. AEBS, then the grouped matmul over this instance's replicas
        y, activated = place_and_run(p, tables, x2, ids, weights, step)
        # 4. this instance's slice of the shared experts (shared_experts: experts)
        if "shared" in p:
            y = y + shared_part(p, x2).astype(y.dtype)
        coact, used = counters(ids, L)
        return partial_out(y, x2, B, T), coact, activated, used

    def run(p, tables, x, valid, step, coact, state):
        mapped = jax.shard_map(
            per_instance,
            mesh=sub.experts,
            in_specs=(param_specs(p, tp), P(), P(), P(), P(), P()),
            out_specs=(P(EXP), P(), P(), P()),
            check_vma=False,  # coact/used are replicated by construction (same inputs everywhere)
        )
        partials, step_coact, activated, used = mapped(p, tables, x, valid, step, state)
        return partials, coact + step_coact, activated, used

    def gate(p, x, valid, state, L):  # per-expert queues: the gate alone; every assignment joins its queue
        B, T, D = x.shape
        ids, weights = routing.route(gate_params(p), cfg.moe, x.reshape(B * T, D), valid.reshape(B * T), state)
        return ids, weights, *counters(ids, L)

    def route(p, x, valid, coact, state):
        mapped = jax.shard_map(
            functools.partial(gate, L=coact.shape[0]),  # the E + U logical experts
            mesh=sub.experts,
            in_specs=(param_specs(p, tp), P(), P(), P()),
            out_specs=(P(), P(), P(), P()),
            check_vma=False,  # replicated by construction (same inputs everywhere)
        )
        ids, weights, step_coact, used = mapped(p, x, valid, state)
        return ids, weights, coact + step_coact, used

    def serve_instance(p, tables, x, queued, weights, step, lo, hi):
        # one round: the queued assignments at experts [lo, hi) leave their queues (AEBS places them)
        B, T, D = x.shape
        x2 = x.reshape(B * T, D)
        mine = (queued >= lo) & (queued < hi)
        y, activated = place_and_run(p, tables, x2, jnp.where(mine, queued, -1), weights, step)
        if "shared" in p:  # the shared experts once per layer: with the first round
            y = y + jnp.where(lo == 0, shared_part(p, x2), 0).astype(y.dtype)
        return partial_out(y, x2, B, T), activated, jnp.where(mine, -1, queued)

    def serve(p, tables, x, queued, weights, step, lo, hi):
        mapped = jax.shard_map(
            serve_instance,
            mesh=sub.experts,
            in_specs=(param_specs(p, tp), P(), P(), P(), P(), P(), P(), P()),
            out_specs=(P(EXP), P(), P()),
            check_vma=False,
        )
        return mapped(p, tables, x, queued, weights, step, lo, hi)

    replicated = NamedSharding(sub.experts, P())
    partials = NamedSharding(sub.experts, P(EXP))
    jit = program_jit(invariant)
    # each runs only on the processes that hold expert devices (``process_local``: the placeholders
    # elsewhere take the shard_maps' output shardings)
    return ExpertProgram(
        run=ProcessLocal(jit(run, donate_argnums=(5,)), sub.experts, (partials, replicated, replicated, replicated)),
        replicated=replicated,
        route=ProcessLocal(jit(route, donate_argnums=(3,)), sub.experts, (replicated,) * 4),
        serve=ProcessLocal(jit(serve), sub.experts, (partials, replicated, replicated)),
        fallback_above=fallback_above(ffn_impl, C, cfg.moe.top_k),
        aebs_impl=aebs_impl,
    )


# --------------------------------------------------------------------------- weight layout


def place_layer(
    layer: dict,
    layout: ReplicaLayout,
    sub: SubMeshes,
    shared_on_experts: bool,
    routing: ExpertRouting = TOP_K,
    index: int = 0,
) -> dict:
    """One MoE layer's expert-side parameters on the expert mesh.

    ``layer["moe"]`` in ``routing``'s logical form (``ExpertRouting.logical_params``) holds the
    weights of the E + U logical experts [E + U, ...]; slot s gets logical expert
    ``layout.slot_to_expert[s]`` (zeros when -1), so the routing's extra experts (e.g. united experts,
    E + u) are placed and replicated like the originals. Each expert device receives only its own slots
    (built from a host copy, so no device ever holds all S slots). With ``shared_on_experts`` the
    layer's shared experts come along, their hidden width zero-padded to a multiple of N and
    split over instances. The routing's other per-layer arrays come along replicated (``index``: the
    layer, for errors).
    """
    moe = routing.logical_params(layer["moe"])
    out = {k: v for k, v in moe.items() if k not in WEIGHTS}
    weights = {k: moe[k] for k in WEIGHTS}
    if layout.num_experts != weights["w_gate"].shape[0]:
        raise ValueError(
            f"MoE layer {index}: the placement has {layout.num_experts} logical experts, "
            f"the weights {weights['w_gate'].shape[0]}"
        )
    idx, used = layout.gather_index(), layout.used()
    tp = sub.spec.experts.devices_per_instance > 1

    def place(host, name):
        host = np.asarray(host)
        shape = (layout.num_slots,) + host.shape[1:]

        def shard(index):
            rows = np.arange(layout.num_slots)[index[0]]
            part = host[(idx[rows],) + tuple(index[1:])]  # this device's slots (and columns: expert_tp)
            return np.where(used[rows].reshape((-1,) + (1,) * (host.ndim - 1)), part, 0).astype(host.dtype)

        sharding = NamedSharding(sub.experts, slot_spec(name, tp, shape))
        return jax.make_array_from_callback(shape, sharding, shard, dtype=host.dtype)

    # a quantized weight: its values and scales alike, slot by slot
    out.update(with_slot_arrays(weights, {name: place(a, name) for name, a in slot_arrays(weights).items()}))
    if not tp:
        out.update({k: _int8_as_panels(out[k], sub) for k in SLOT_WEIGHTS})
    if shared_on_experts and "shared" in layer:
        n = sub.spec.experts.count
        shared = dict(layer["shared"])
        pad = -shared["w_gate"].shape[1] % n
        if pad:
            shared["w_gate"] = jnp.pad(shared["w_gate"], ((0, 0), (0, pad)))
            shared["w_up"] = jnp.pad(shared["w_up"], ((0, 0), (0, pad)))
            shared["w_down"] = jnp.pad(shared["w_down"], ((0, pad), (0, 0)))
        out["shared"] = shared
    specs = param_specs(out, tp)
    return {
        k: (v if k in ("w_gate", "w_up", "w_down") else jax.device_put(v, _shardings(sub.experts, specs[k])))
        for k, v in out.items()
    }


def _int8_as_panels(w, sub: SubMeshes):
    """An int8 slot weight's values as column ``Panels`` (each device its own slots), the layout the CPU
    expert kernel reads fastest (plain int8 slots took 1.3-1.4x its time at 1 and 16 tokens, D 2048,
    F 5632, 4 slots: bench/results/2026-12-07-quantdisagg.md); other weights, and shapes no panel width
    divides, as they are."""
    width = width_for(*w.shape[-2:])
    if getattr(w, "method", None) != "int8" or isinstance(w.q, Panels) or width is None:
        return w
    sharding = NamedSharding(sub.experts, _SLOT_SPEC)
    q = jax.jit(lambda a: to_panels(a, width), out_shardings=Panels(sharding, width))(w.q)
    return Quantized(q, w.scale, w.block)


def relayout_layer(
    placed: dict, old: ReplicaLayout, new: ReplicaLayout, sub: SubMeshes, collective: bool | None = None
) -> tuple[dict, int]:
    """Move one layer's slot arrays from placement ``old`` to ``new`` (the controller's hook).

    Slot s of the new layout keeps its data when it hosts the same expert as before; otherwise it
    copies a slot of the old layout hosting that expert, preferring one on the same instance
    (a local copy), then one on the same node, over any other. Unused slots become zeros.
    Returns (new params, slots moved across instances).

    Two ways to copy, with the same result: one ``jax.device_put`` of one expert's weights to each
    device of the instance, when this process addresses every expert device (or none); and, when
    the expert sub-mesh spans processes (``jax.distributed``), collectives
    (``slot_moves.SlotMover``: ppermute rounds carrying only the moved slots; every process
    calls it). ``collective``: force one way (None: pick as just said).
    """
    C = new.slots_per_instance
    spec = sub.spec
    insts = spec.experts.devices
    plan = _source_slots(old, new, spec)
    moved = sum(1 for s, src in enumerate(plan) if src >= 0 and src // C != s // C)
    tp = sub.spec.experts.devices_per_instance > 1
    if collective is None:
        collective = len({dev.process_index for dev in sub.experts.devices.flat}) > 1
    if collective and tp:
        raise NotImplementedError(
            f"set_placement: {sub.spec.source}: experts.devices_per_instance: {sub.spec.experts.devices_per_instance}"
            " (FFN columns split) with the expert sub-mesh spanning processes: collective slot moves"
            " carry whole slots only (not built)"
        )
    sharding = NamedSharding(sub.experts, _SLOT_SPEC)
    if collective:
        keep, copies = {}, []
        for j, inst in enumerate(insts):
            for t, d in enumerate(inst):
                rows = []
                for c, src in enumerate(plan[j * C : (j + 1) * C]):
                    src_dev = insts[src // C][t] if src >= 0 else -1
                    rows.append(src % C if src_dev == d else -1)
                    if src >= 0 and src_dev != d:
                        copies.append(slot_moves.RowCopy(src_dev, src % C, d, c))
                keep[d] = tuple(rows)
        moves = slot_moves.SlotPlan(tuple(sorted(spec.experts.flat)), C, C, keep, tuple(copies))
        arrays = slot_moves.mover_for(sub).run(moves, slot_arrays(placed), sharding, new.num_slots)
        return with_slot_arrays(placed, arrays), moved
    arrays = {}
    for name, arr in slot_arrays(placed).items():
        sharding = NamedSharding(sub.experts, slot_spec(name, tp, arr.shape))
        shards = {sh.device: sh.data for sh in arr.addressable_shards}
        local_shape = arr.sharding.shard_shape(arr.shape)[1:]  # one slot on one device
        per_device = []
        for j, inst in enumerate(insts):
            for t, d in enumerate(inst):
                dev = sub.devices[d]
                if dev.process_index != jax.process_index():
                    continue
                pieces = []
                for s in range(j * C, (j + 1) * C):
                    src = plan[s]
                    if src < 0:
                        pieces.append(jax.device_put(np.zeros((1,) + local_shape, arr.dtype), dev))
                        continue
                    src_dev = sub.devices[insts[src // C][t]]
                    piece = shards[src_dev][src % C : src % C + 1]
                    pieces.append(piece if src_dev == dev else jax.device_put(piece, dev))
                per_device.append(jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0])
        arrays[name] = jax.make_array_from_single_device_arrays(arr.shape, sharding, per_device, dtype=arr.dtype)
    return with_slot_arrays(placed, arrays), moved


def slot_arrays(placed: dict) -> dict[str, jax.Array]:
    """A placed layer's routed-expert slot arrays [S, ...] by name: ``w_gate``, ``w_up``, ``w_down``, or
    for an int8 / fp8 weight (``jaxmoe.quantization.Quantized``) its values and scales, ``w_gate.q`` (as
    column panels: ``w_gate.q[0]``) and ``w_gate.scale``: what moves slot by slot (re-placement,
    re-scaling), so scales move with their weights."""
    out = {}
    for k in SLOT_WEIGHTS:
        for path, a in jax.tree_util.tree_flatten_with_path(placed[k])[0]:
            out[k + jax.tree_util.keystr(path)] = a
    return out


def with_slot_arrays(placed: dict, arrays: dict[str, jax.Array]) -> dict:
    """``placed`` with its slot arrays replaced by ``arrays`` (named as ``slot_arrays`` names them)."""
    out = dict(placed)
    for k in SLOT_WEIGHTS:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(placed[k])
        out[k] = treedef.unflatten([arrays[k + jax.tree_util.keystr(path)] for path, _ in leaves])
    return out


def weight_name(slot_array: str) -> str:
    """The weight a ``slot_arrays`` name belongs to (``w_gate.scale`` -> ``w_gate``)."""
    return slot_array.split(".")[0]


def _source_slots(old: ReplicaLayout, new: ReplicaLayout, spec) -> list[int]:
    """Per new slot, the old slot it copies (-1: unused): itself when it hosts the same expert,
    else a replica on the same instance, else one on the same node, else any replica; among
    remote candidates the instance that sends least so far (copies spread over sources, so fewer
    collective rounds), the first on ties."""
    C_old, C = old.slots_per_instance, new.slots_per_instance
    insts = spec.experts.devices
    sends: dict[int, int] = {}  # old instance -> copies it sends
    plan: list[int] = []
    for s, e in enumerate(new.slot_to_expert):
        if e < 0:
            plan.append(-1)
        elif old.slot_to_expert[s] == e:
            plan.append(s)
        else:
            hosts = old.replicas(e)
            node = spec.node_of(insts[s // C][0])
            same_inst = [h for h in hosts if h // C_old == s // C]
            if same_inst:
                plan.append(same_inst[0])
                continue
            same_node = [h for h in hosts if spec.node_of(insts[h // C_old][0]) == node]
            src = min(same_node or hosts, key=lambda h: sends.get(h // C_old, 0))
            sends[src // C_old] = sends.get(src // C_old, 0) + 1
            plan.append(src)
    return plan


def place_tables(layout: ReplicaLayout, sub: SubMeshes) -> dict:
    """AEBS's replica table and replica -> instance map, replicated on the expert mesh."""
    rep = NamedSharding(sub.experts, P())
    return {
        "replica_table": jax.device_put(layout.replica_table(), rep),
        "replica_instance": jax.device_put(layout.replica_instance(), rep),
    }
