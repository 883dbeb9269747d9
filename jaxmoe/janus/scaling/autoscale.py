"""``jaxmoe serve --autoscale``: the closed scaling loop driving live re-scaling of the running engine.

``Autoscaler`` is an engine step hook (and ``ReportsStats`` under ``autoscale``). After every step
that ran the model it measures (``closed_loop.WindowMeter``): per-token decode time, SLO
violations, waiting requests and time to first token, KV blocks in use per attention instance and
activated replicas per expert instance. Every ``interval_s`` (or at once when the window so far is
over the SLO) it hands the window to ``closed_loop.ClosedLoopController`` (one controller per
sub-cluster, the performance model checked against the measured TPOT) and, when the layout it
decides differs from the one serving, starts a live rescale (``janus.live_rescale``: built in the
background, swapped in at a step boundary; one at a time). docs/scaling.md states the rules.

The performance model (a ``perf_model.DisaggregatedPerf``) is the one fitted from the engine's own
measurements on this mesh when a scaling profile for the mesh's devices, the model and the dtype is
given or exists in the directory given (``fitted.FittedPerfModel``; ``jaxmoe serve
--scaling-profile FILE|DIR``; made by ``jaxmoe scaling-profile --out FILE|DIR``), else ``perf_model.PerfModel`` with the served model's shape
(``model_shape``) on ``hardware``: on the CPU mesh ``host_hardware`` measures the host's copy
bandwidth and matmul rate once (a rough roofline; the loop's correction factor absorbs its scale).
It runs only while the engine steps (an idle engine keeps its layout).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import numpy as np

from jaxmoe.janus.live_rescale import LiveRescaler
from jaxmoe.janus.scaling.closed_loop import ClosedLoopController, Window, WindowMeter
from jaxmoe.janus.scaling.controller import Layout, Load
from jaxmoe.janus.scaling.fitted import FittedPerfModel, ScalingProfile, find_profile, mesh_family
from jaxmoe.janus.scaling.perf_model import DisaggregatedPerf, Hardware, ModelShape, PerfModel

log = logging.getLogger(__name__)


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
    window: Window  # what the window before the decision measured
    layout: Layout  # what the controller decided
    started: bool  # a rescale was started (else: already serving it, or one in progress)
    error: str | None = None
    urgent: bool = False  # decided before the interval ended: the SLO was already violated

    @property
    def load(self) -> Load:
        return self.window.load


class Autoscaler:
    """The closed scaling loop as an engine step hook (``closed_loop``); ``ReportsStats`` under
    ``autoscale``.

    ``controller.decide(window, serving)`` gets every window; ``check_s`` (default: a tenth of the
    interval): how often the window so far is checked for an SLO violation that decides at once
    (scale-ups need not wait for the interval's end). ``rescaler``: what starts rescales (default:
    the engine's ``LiveRescaler``)."""

    stats_key = "autoscale"

    def __init__(
        self,
        engine,
        controller,
        interval_s: float = 30.0,
        clock=time.monotonic,
        check_s: float | None = None,
        rescaler=None,
        expert_util_every_s: float | None = None,
    ):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.engine, self.controller, self.interval_s, self.clock = engine, controller, interval_s, clock
        self.check_s = interval_s / 10 if check_s is None else check_s
        self.expert_util_every_s = interval_s / 8 if expert_util_every_s is None else expert_util_every_s
        self.rescaler = rescaler if rescaler is not None else LiveRescaler.of(engine)
        self.slo = float(getattr(controller, "slo", math.inf))
        controller.current = self.serving()
        now = clock()
        self._admitted = engine.scheduler.num_admitted
        self.meter = WindowMeter(self.slo, now, engine.scheduler.num_waiting)
        self._window_layout = controller.current
        self._t0 = self._last_check = now
        self._expert_sampled = -math.inf
        self._expert_util_ok = True
        self.decisions: list[Decision] = []
        self.rescales_started = 0
        self.last_window: Window | None = None

    def serving(self) -> Layout:
        """The layout serving now (from the executor; among the controller's layouts when it has them)."""
        ex = self.engine.executor
        a, e = ex.num_attention, ex.num_expert_instances
        for layout in getattr(self.controller, "layouts", ()):
            if (layout.attention, layout.experts) == (a, e):
                return layout
        spec = ex.sub.spec
        ka, ke = spec.attention.devices_per_instance, spec.experts.devices_per_instance
        return Layout(a * ka + e * ke, a, e)

    # -- the step hook ---------------------------------------------------------------------------
    def before_step(self, engine) -> None:
        self._t0 = self.clock()

    def after_step(self, engine, outputs) -> None:
        """Measure the step (only while the engine runs steps: an idle engine keeps its layout), then
        decide when the interval has passed or the window so far violates the SLO."""
        if not engine.last_step_ran:
            return
        now = self.clock()
        decoded, contexts, ttft = [], [], []
        for out in outputs:
            n = len(out.delta_token_ids)
            if n and len(out.token_ids) == n:  # the request's first token(s): prefill, not decode
                if out.ttft is not None:
                    ttft.append(out.ttft)
                n -= 1
            if n > 0:
                decoded.append(n)
                contexts.append(len(out.prompt_token_ids) + len(out.token_ids))
        self.meter.observe(now - self._t0, decoded, contexts, waiting=engine.scheduler.num_waiting, ttft=ttft)
        self.meter.utilization(attention=self.attention_utilization())
        if decoded and now - self._expert_sampled >= self.expert_util_every_s:
            self._expert_sampled = now
            self.meter.utilization(experts=self.expert_utilization())
        self.tick(now)

    def tick(self, now: float | None = None) -> Decision | None:
        """Decide if it is time: the interval ended, or (checked every ``check_s``) the window so far
        is over the SLO. No decision while a rescale is in progress; a window during which the
        serving layout changed is dropped."""
        now = self.clock() if now is None else now
        serving = self.serving()
        if serving != self._window_layout:  # a rescale was swapped in: measure the new layout afresh
            self._window_layout = serving
            self._close(now)
            return None
        if self.rescaler.job is not None:  # one rescale at a time; its build competes with the steps
            if now - self.meter.start >= self.interval_s:
                self._close(now)  # what the steps measured meanwhile says little about either layout
            return None
        if now - self.meter.start >= self.interval_s:
            return self.decide(now)
        if now - self._last_check >= self.check_s:
            self._last_check = now
            p90, _ = self.meter.partial_p90()
            if p90 is not None and p90 > self.slo and now - self.meter.start >= self.check_s:
                return self.decide(now, urgent=True)
        return None

    # -- measurements ------------------------------------------------------------------------------
    def attention_utilization(self) -> list[float]:
        """Per attention instance: the share of its KV partition's blocks in use."""
        bm = self.engine.block_manager
        n = bm.blocks_per_partition
        return [(n - bm.num_free_in(p)) / n for p in range(bm.num_partitions)]

    def running_per_instance(self) -> list[int]:
        """Per attention instance: the running sequences whose KV it holds."""
        bm = self.engine.block_manager
        counts = [0] * bm.num_partitions
        for seq in self.engine.scheduler.running:
            p = bm.partition_of(seq)
            if p is not None:
                counts[p] += 1
        return counts

    def expert_utilization(self) -> list[float] | None:
        """Per expert instance: the replicas it ran in the last step (mean over MoE layers) over its
        slots; None when the executor does not count them."""
        ex = self.engine.executor
        count = getattr(ex, "activated_per_instance", None)
        if count is None or not self._expert_util_ok:
            return None
        try:
            per_layer = count()
        except Exception:  # never fail a step for a measurement
            log.exception("activated_per_instance() failed: expert utilization is no longer measured")
            self._expert_util_ok = False
            return None
        if not per_layer:
            return None
        return [float(v) / ex.slots_per_instance for v in np.mean(list(per_layer.values()), axis=0)]

    def _close(self, now: float) -> Window:
        admitted = self.engine.scheduler.num_admitted
        live = self.engine.scheduler.sequences()
        out = float(np.mean([s.max_tokens or 1 for s in live])) if live else 1.0
        window = self.meter.close(now, admitted - self._admitted, out)
        self._admitted, self._last_check = admitted, now
        return window

    def decide(self, now: float | None = None, urgent: bool = False) -> Decision:
        """Close the window, ask the controller, start a rescale when it wants another layout (one
        at a time)."""
        now = self.clock() if now is None else now
        window = self.last_window = self._close(now)
        serving = self.serving()
        layout = self.controller.decide(window, serving)
        decision = Decision(now, window, layout, started=False, urgent=urgent)
        if layout != serving and self.rescaler.job is None:
            try:
                self.rescaler.start(layout.attention, layout.experts)
                decision.started = True
                self.rescales_started += 1
            except ValueError as e:  # RescaleError: e.g. a live request too long for the layout
                decision.error = str(e)
        self.decisions.append(decision)
        return decision

    def stats(self) -> dict:
        """For ``EngineStats``: the serving layout, the last window, the model check, per-side state."""
        serving = self.serving()
        w = self.last_window
        out = {
            "slo_tpot_s": self.slo,
            "interval_s": self.interval_s,
            "attention": serving.attention,
            "experts": serving.experts,
            "decisions": len(self.decisions),
            "rescales_started": self.rescales_started,
            "window": None if w is None else w.as_dict(),
            "attention_utilization": self.attention_utilization(),
            "running_per_instance": self.running_per_instance(),
        }
        if hasattr(self.controller, "stats"):
            out.update(self.controller.stats())
        return out


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
    return engine.add_hook(Autoscaler(engine, ClosedLoopController(pm, layouts, slo_tpot_s), interval_s))
