"""``jaxmoe serve --autoscale``: the scaling controller driving live re-scaling of the running engine.

``Autoscaler`` is an engine step hook. Every ``interval_s`` it measures the load the engine saw
(arrival rate since the last decision, mean requested output tokens and mean context of the live
requests), asks ``ScalingController.decide`` for a layout among those that fit the mesh's devices
and expert slots, and when that differs from the layout serving, starts a live rescale
(``janus.live_rescale``: built in the background, swapped in at a step boundary; one at a time). The controller's hysteresis applies:
up at once, down only after ``down_after`` agreeing decisions.

The performance model (a ``perf_model.DisaggregatedPerf``) is the one fitted from the engine's own
measurements on this mesh when a scaling profile for the mesh's devices, the model and the dtype is
given or exists in the directory given (``fitted.FittedPerfModel``; ``jaxmoe serve
--scaling-profile FILE|DIR``; made by ``jaxmoe scaling-profile --out FILE|DIR``), else ``perf_model.PerfModel`` with the served model's shape
(``model_shape``) on ``hardware``: on the CPU mesh ``host_hardware`` measures the host's copy
bandwidth and matmul rate once (a rough roofline, not fitted per layout). It runs only while the
engine steps (an idle engine keeps its layout).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import numpy as np

from jaxmoe.janus.live_rescale import LiveRescaler
from jaxmoe.janus.scaling.controller import JANUS, Layout, Load, ScalingController
from jaxmoe.janus.scaling.fitted import FittedPerfModel, ScalingProfile, find_profile, mesh_family
from jaxmoe.janus.scaling.perf_model import DisaggregatedPerf, Hardware, ModelShape, PerfModel


def model_shape(cfg, params_bytes: int, expert_bytes: int, dtype_bytes: int) -> ModelShape:
    """The served model's shape for the performance model (bytes from its parameters)."""
    a = cfg.attn
    kv = (a.kv_lora_rank + a.qk_rope_head_dim) if a.kind == "mla" else 2 * a.num_kv_heads * a.head_dim
    return ModelShape(
        cfg.family,
        layers=cfg.num_layers,
        moe_layers=cfg.num_moe_layers,
        hidden=cfg.hidden_size,
        experts=cfg.moe.num_experts,
        top_k=cfg.moe.top_k,
        expert_bytes_total=float(expert_bytes),
        other_bytes_total=float(params_bytes - expert_bytes),
        kv_bytes_per_token_layer=float(kv * dtype_bytes),
        dtype_bytes=dtype_bytes,
    )


def host_hardware(devices: int, memory_bytes: float = 16e9, size: int = 1 << 24) -> Hardware:
    """The host CPU as ``devices`` devices sharing it: copy bandwidth and fp32 matmul rate measured
    once (best of 3), split over the devices."""
    a = np.ones(size // 4, np.float32)
    best_copy = min(_timed(lambda: a.copy()) for _ in range(3))
    m = np.ones((512, 512), np.float32)
    best_mm = min(_timed(lambda: m @ m) for _ in range(3))
    return Hardware(
        "host CPU",
        memory_bandwidth=2 * a.nbytes / best_copy / devices,
        flops=2 * 512**3 / best_mm / devices,
        memory=memory_bytes / devices,
        link_bandwidth=2 * a.nbytes / best_copy / devices,
        link_alpha=20e-6,
        gpus_per_node=devices,
    )


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return max(time.perf_counter() - t, 1e-9)


def layouts_that_fit(
    num_devices: int, num_experts: int, slots_per_instance: int, attention_devices: int = 1, expert_devices: int = 1
) -> list[Layout]:
    """Every aXeY on ``num_devices`` devices whose slots hold the experts, with ``attention_devices``
    devices per attention instance and ``expert_devices`` per expert instance (tensor parallelism:
    a rescale keeps them); ``Layout.gpus`` counts the devices used."""
    ka, ke = attention_devices, expert_devices
    e_min = math.ceil(num_experts / slots_per_instance)
    return [
        Layout(a * ka + e * ke, a, e)
        for a in range(1, num_devices // ka + 1)
        for e in range(e_min, (num_devices - a * ka) // ke + 1)
    ]


@dataclasses.dataclass
class Decision:
    time: float
    load: Load
    layout: Layout  # what the controller decided
    started: bool  # a rescale was started (else: already serving it, or one in progress)
    error: str | None = None


class Autoscaler:
    def __init__(self, engine, controller: ScalingController, interval_s: float = 30.0, clock=time.monotonic):
        self.engine, self.controller, self.interval_s, self.clock = engine, controller, interval_s, clock
        self.rescaler = LiveRescaler.of(engine)
        ex = engine.executor
        spec = ex.sub.spec
        controller.current = Layout(
            len(spec.attention.flat) + len(spec.experts.flat), ex.num_attention, ex.num_expert_instances
        )
        self._last, self._admitted = clock(), engine.scheduler.num_admitted
        self.decisions: list[Decision] = []

    def before_step(self, engine) -> None:
        pass

    def after_step(self, engine, outputs) -> None:
        """Step hook: decide when ``interval_s`` has passed since the last decision (only while the
        engine runs steps)."""
        if engine.last_step_ran and self.clock() - self._last >= self.interval_s:
            self.decide()

    def measure(self) -> Load:
        now, admitted = self.clock(), self.engine.scheduler.num_admitted
        rate = (admitted - self._admitted) / max(now - self._last, 1e-9)
        self._last, self._admitted = now, admitted
        live = self.engine.scheduler.sequences()
        out = float(np.mean([s.max_tokens or 1 for s in live])) if live else 1.0
        context = float(np.mean([s.num_tokens for s in live])) if live else 1.0
        return Load(rate, out, context)

    def decide(self) -> Decision:
        load = self.measure()
        layout = self.controller.decide(load)
        ex = self.engine.executor
        serving = (ex.num_attention, ex.num_expert_instances) == (layout.attention, layout.experts)
        decision = Decision(self.clock(), load, layout, started=False)
        if not serving and self.rescaler.job is None:
            try:
                self.rescaler.start(layout.attention, layout.experts)
                decision.started = True
            except ValueError as e:  # RescaleError: e.g. a live request too long for the layout
                decision.error = str(e)
        self.decisions.append(decision)
        return decision


def roofline_model(engine, hardware: Hardware | None = None) -> PerfModel:
    """The roofline ``PerfModel`` of the served model (bytes from its parameters) on ``hardware``
    (default: the host, measured once: ``host_hardware``)."""
    import jax

    ex = engine.executor
    params = jax.tree.leaves(ex.params)
    total = sum(p.nbytes for p in params)
    experts = sum(
        ex.expert_side.layers[i][k].nbytes * ex.cfg.moe.num_experts // ex.expert_side.layouts[i].num_slots
        for i in ex.moe_layers
        for k in ("w_gate", "w_up", "w_down")
    )
    dtype_bytes = jax.tree.leaves(ex.cache)[0].dtype.itemsize
    return PerfModel(
        model_shape(ex.cfg, total, experts, dtype_bytes), hardware or host_hardware(ex.sub.spec.num_devices)
    )


def fitted_model(engine, profile) -> FittedPerfModel | None:
    """A ``FittedPerfModel`` of the served engine from a scaling profile: a ``ScalingProfile``, the
    path of its JSON (``ProfileError`` naming the field when it was made for another mesh's devices
    and slots, model or dtype), or a directory (the profile made for this mesh, model and dtype,
    ``fitted.find_profile``; None when it has none)."""
    from jaxmoe.findep.profile import model_identity

    ex, cfg = engine.executor, engine.config
    model, dtype = model_identity(ex.cfg), str(np.dtype(ex.params["embed"].dtype))
    if not isinstance(profile, ScalingProfile):
        if Path(profile).is_dir():
            profile = find_profile(profile, mesh_family(ex.sub.spec), model, dtype)
            if profile is None:
                return None
        profile = ScalingProfile.load(profile)
    profile.check(model=model, dtype=dtype)
    return FittedPerfModel(profile, ex.sub.spec, cfg.num_blocks * cfg.block_size, cfg.max_num_seqs)


def attach(
    engine,
    slo_tpot_s: float,
    interval_s: float = 30.0,
    hardware: Hardware | None = None,
    profile=None,
) -> Autoscaler:
    """An ``Autoscaler`` for a mesh-file engine, run after every step (``jaxmoe serve --autoscale``).
    Its performance model: the fitted one when a scaling ``profile`` (a file, a directory holding
    one for this mesh, model and dtype, or a ``ScalingProfile``) is given (``fitted_model``), else
    the host roofline (``roofline_model``)."""
    pm: DisaggregatedPerf | None = None if profile is None else fitted_model(engine, profile)
    if pm is None:
        pm = roofline_model(engine, hardware)
    ex = engine.executor
    spec = ex.sub.spec
    layouts = layouts_that_fit(
        spec.num_devices,
        ex.cfg.moe.num_experts,
        ex.slots_per_instance,
        spec.attention.devices_per_instance,
        spec.experts.devices_per_instance,
    )
    return engine.add_hook(Autoscaler(engine, ScalingController(pm, JANUS, layouts, slo_tpot_s), interval_s))
