"""The closed scaling loop (``jaxmoe.janus.scaling.closed_loop`` and the ``Autoscaler`` hook) on
simulated time: a load that rises then falls, the model check (re-fit, fallback), the measurements
the hook takes from a step's outputs, and the metrics it exports. No model runs: the engine is a
fluid simulation of decode steps whose time is the performance model's TPOT times a hidden factor."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from jaxmoe.engine.block_manager import BlockManager
from jaxmoe.engine.hooks import ReportsStats
from jaxmoe.engine.outputs import RequestOutput
from jaxmoe.engine.sequence import Sequence
from jaxmoe.janus.scaling.autoscale import Autoscaler, layouts_that_fit
from jaxmoe.janus.scaling.closed_loop import ClosedLoopController, Window, WindowMeter
from jaxmoe.janus.scaling.controller import Layout
from jaxmoe.janus.scaling.perf_model import PerfModel, activated_per_instance

PAPER_INTERVAL_S = 30 * 60.0  # JANUS section 5: the scaling decision interval of its trace replay
SLO = 0.1
OUTPUT = 256
CONTEXT = 16 + OUTPUT / 2
SLOTS = 27  # DeepSeek-V2's 160 experts need 6 expert instances
BLOCKS_PER_INSTANCE = 4096


class FakeRescaler:
    """Starts a rescale that the simulation swaps in ``delay_s`` later."""

    def __init__(self, delay_s: float):
        self.delay_s, self.job, self.started = delay_s, None, []

    def start(self, attention: int, experts: int):
        self.job = types.SimpleNamespace(attention=attention, experts=experts, at=None)
        self.started.append((attention, experts))
        return self.job


class SimEngine:
    """What the autoscaler reads of an engine, fed by a fluid model of decode steps: ``true_tpot``
    gives the step time of a batch on a layout; requests arrive at ``rate(t)``, join the batch while
    the KV cache holds them, and leave after ``OUTPUT`` tokens."""

    def __init__(self, pm: PerfModel, attention: int, experts: int, true_tpot):
        self.pm, self.true_tpot = pm, true_tpot
        self.executor = types.SimpleNamespace(
            num_attention=attention, num_expert_instances=experts, slots_per_instance=SLOTS
        )
        self.scheduler = types.SimpleNamespace(num_admitted=0, num_waiting=0, running=[], sequences=lambda: [])
        self.last_step_ran = True
        self.hooks = []
        self.batch = self.waiting = self.arrived = 0.0

    @property
    def block_manager(self) -> BlockManager:
        a = self.executor.num_attention
        return BlockManager(num_blocks=4 * a, block_size=16, num_partitions=a)

    def advance(self, rate: float, dt: float) -> dict:
        """``dt`` seconds of serving at ``rate`` requests/s; returns what the steps measured."""
        a, e = self.executor.num_attention, self.executor.num_expert_instances
        self.arrived += rate * dt
        self.scheduler.num_admitted = int(self.arrived)
        self.waiting += rate * dt
        cap = self.pm.kv_capacity(a, CONTEXT)
        admit = min(self.waiting, max(cap - self.batch, 0.0))
        self.batch += admit
        self.waiting -= admit
        batch = max(int(round(self.batch)), 1)
        tpot = self.true_tpot(batch, a, e)
        steps = dt / tpot
        self.batch -= min(self.batch, self.batch * steps / OUTPUT)
        self.scheduler.num_waiting = int(round(self.waiting))
        return {"tpot": tpot, "steps": steps, "batch": batch, "cap": cap}


def run_trace(rates: np.ndarray, dt: float, true_factor, start=(1, 6), delay_s: float = 60.0):
    """Serve per-``dt`` rates under the closed loop; per chunk: (time, tpot, layout, decision)."""
    pm = PerfModel()
    layouts = layouts_that_fit(24, 160, SLOTS)
    ctl = ClosedLoopController(pm, layouts, SLO)
    engine = SimEngine(pm, *start, lambda b, a, e: true_factor(b) * pm.tpot_disaggregated(b, CONTEXT, a, e))
    now = [0.0]
    rescaler = FakeRescaler(delay_s)
    scaler = Autoscaler(engine, ctl, interval_s=PAPER_INTERVAL_S, clock=lambda: now[0], rescaler=rescaler)
    rows = []
    for rate in rates:
        job = rescaler.job
        if job is not None:
            job.at = now[0] + delay_s if job.at is None else job.at
            if now[0] >= job.at:  # swapped in at a step boundary
                engine.executor.num_attention, engine.executor.num_expert_instances = job.attention, job.experts
                rescaler.job = None
        m = engine.advance(float(rate), dt)
        now[0] += dt
        a, e = engine.executor.num_attention, engine.executor.num_expert_instances
        scaler.meter.observe(
            m["tpot"], np.ones(m["batch"], int), [CONTEXT], steps=m["steps"], waiting=engine.scheduler.num_waiting
        )
        act = activated_per_instance(160, 6, m["batch"], e, SLOTS, True)
        scaler.meter.utilization(attention=[engine.batch / m["cap"]] * a, experts=[act / SLOTS] * e)
        decision = scaler.tick(now[0])
        if decision is not None:
            decision.reasons = {s: c.last.reason for s, c in ctl.sides.items() if c.last is not None}
            decision.fallback = ctl.fallback
        rows.append((now[0], m["tpot"], (a, e), decision))
    return rows, scaler, ctl


def longest_violation_s(rows, dt: float) -> float:
    longest = run = 0.0
    for _, tpot, _, _ in rows:
        run = run + dt if tpot > SLO else 0.0
        longest = max(longest, run)
    return longest


def rise_and_fall(hours: float = 8.0, dt: float = 10.0, low: float = 2.0, high: float = 60.0) -> np.ndarray:
    n = int(hours * 3600 / dt)
    up = np.linspace(low, high, n // 2)
    return np.concatenate([up, up[::-1]])


def test_rising_then_falling_load_scales_up_then_down_within_the_slo():
    """The model is 30 % optimistic (the first window's gap re-fits it); the load rises from 2 to
    60 requests/s over 4 hours and falls back: the layout grows, then shrinks, and no stretch over
    the SLO lasts longer than the paper's 30-minute decision interval."""
    dt = 10.0
    rows, scaler, ctl = run_trace(rise_and_fall(dt=dt), dt, lambda b: 1.3)
    gpus = [a + e for _, _, (a, e), _ in rows]
    peak = int(np.argmax(gpus))
    assert gpus[0] == 7 and max(gpus) > 7  # 1A6E at first, larger at the peak
    assert gpus[-1] < max(gpus)  # and smaller again when the load fell
    assert 0.35 < peak / len(rows) < 0.75  # the largest layout around the peak of the load
    assert longest_violation_s(rows, dt) <= PAPER_INTERVAL_S
    assert ctl.refits >= 1 and ctl.model.factor == pytest.approx(1.3, rel=0.05)
    assert ctl.fallbacks == 0  # after the re-fit the model's prediction stays within 20 %
    assert ctl.gap is not None and ctl.gap <= 0.2
    reasons = {ctl.sides[s].last.reason for s in ("attention", "experts")}
    assert reasons <= {"hold", "down", "up:slo", "up:kv", "up:measured"}
    started = [(d.layout.gpus, d.reasons) for *_, d in rows if d is not None and d.started]
    grew = [i for i in range(1, len(started)) if started[i][0] > started[i - 1][0]]
    assert grew and any("down" in r.values() for _, r in started[max(grew) :])  # up first, then down


def test_without_the_closed_loop_the_same_trace_violates_longer():
    """The same trace on the starting layout (no autoscaler) violates the SLO for hours: the test
    above is not passed by the trace alone."""
    pm = PerfModel()
    dt = 10.0
    engine = SimEngine(pm, 1, 6, lambda b, a, e: 1.3 * pm.tpot_disaggregated(b, CONTEXT, a, e))
    rows = [(0, engine.advance(float(r), dt)["tpot"], (1, 6), None) for r in rise_and_fall(dt=dt)]
    assert longest_violation_s(rows, dt) > 2 * PAPER_INTERVAL_S


def test_a_model_whose_error_changes_with_the_batch_falls_back_to_the_measured_rule():
    """True step time grows with the batch far faster than the model's: the gap exceeds 20 % window
    after window although re-fitted each time, so the controller falls back (counted) and decides
    from measured TPOT and utilization; it still scales up under the rising load."""
    dt = 10.0
    rates = rise_and_fall(hours=4.0, dt=dt, low=2.0, high=30.0)
    rows, scaler, ctl = run_trace(rates, dt, lambda b: 1.0 + (b / 150.0) ** 2)
    assert ctl.refits >= 2 and ctl.fallbacks >= 1
    measured = [d for *_, d in rows if d is not None and d.fallback and "up:measured" in d.reasons.values()]
    assert measured  # decided by the measured rule while falling back
    gpus = [a + e for _, _, (a, e), _ in rows]
    assert max(gpus) > gpus[0]
    assert scaler.stats()["model_fallbacks"] == ctl.fallbacks


def window(**kw) -> Window:
    """A decision window; its decode tokens are what ``batch`` sequences at ``tpot_mean_s`` give."""
    base = dict(start=0.0, end=PAPER_INTERVAL_S, decode_steps=100.0, batch=64.0, context=CONTEXT)
    base.update(kw)
    base.setdefault("token_batch", base["batch"])
    if base.get("tpot_mean_s"):
        base.setdefault("tokens", base["batch"] / base["tpot_mean_s"] * (base["end"] - base["start"]))
    return Window(**base)


def controller(**kw) -> ClosedLoopController:
    return ClosedLoopController(PerfModel(), layouts_that_fit(24, 160, SLOTS), SLO, **kw)


def test_measured_violation_scales_up_although_the_model_says_the_layout_suffices():
    ctl = controller()
    cur = Layout(7, 1, 6)
    predicted = ctl.model.tpot_disaggregated(64, CONTEXT, 1, 6)
    assert predicted < 0.85 * SLO  # the model: 1A6E suffices at batch 64
    w = window(tpot_mean_s=predicted, tpot_p90_s=1.5 * SLO, violations=0.3)
    got = ctl.decide(w, cur)
    assert got.gpus == 8 and ctl.refits == 0  # one instance more, the prediction was within 20 %
    side = max(ctl.sides.values(), key=lambda c: c.last.reason == "up:measured")
    assert side.last.reason == "up:measured"


def test_growing_queue_scales_up_and_kv_pressure_adds_attention():
    ctl = controller()
    cur = Layout(7, 1, 6)
    pred = ctl.model.tpot_disaggregated(64, CONTEXT, 1, 6)
    w = window(tpot_mean_s=pred, tpot_p90_s=pred, waiting=40, waiting_growth=30, attention_util=[0.97])
    got = ctl.decide(w, cur)
    assert got.attention >= 2 and ctl.sides["attention"].last.reason in {"up:kv", "up:slo"}


def test_down_needs_headroom_for_down_after_windows_and_the_model_agreeing():
    ctl = controller(down_after=2)
    cur = Layout(12, 4, 8)
    pred = ctl.model.tpot_disaggregated(16, CONTEXT, 4, 8)
    calm = dict(batch=16.0, tpot_mean_s=pred, tpot_p90_s=pred, attention_util=[0.1] * 4, expert_util=[0.3] * 8)
    assert ctl.decide(window(**calm), cur) == cur  # one window with headroom: hold
    small = ctl.decide(window(**calm), cur)
    assert small.gpus < cur.gpus and ctl.model.tpot_disaggregated(16, CONTEXT, small.attention, small.experts) <= (
        0.85 * SLO
    )
    # near the SLO (P90 above (1 - headroom) x SLO): no down votes
    ctl = controller(down_after=1)
    near = dict(calm, tpot_p90_s=0.8 * SLO)
    assert ctl.decide(window(**near), cur) == cur


def test_gap_beyond_20_percent_refits_then_falls_back():
    ctl = controller(fallback_after=2)
    cur = Layout(7, 1, 6)
    raw = ctl.model.raw_tpot(64, CONTEXT, 1, 6)
    ctl.decide(window(tpot_mean_s=1.15 * raw, tpot_p90_s=1.15 * raw), cur)
    assert ctl.refits == 0 and ctl.gap == pytest.approx(0.15 / 1.15, rel=1e-6)  # within 20 %: kept
    ctl.decide(window(tpot_mean_s=2 * raw, tpot_p90_s=2 * raw), cur)
    assert ctl.refits == 1 and ctl.model.factor == pytest.approx(2.0) and not ctl.fallback
    assert ctl.predicted_s == pytest.approx(1.0 * raw)  # the prediction before the re-fit is what is compared
    ctl.decide(window(tpot_mean_s=0.7 * raw, tpot_p90_s=0.7 * raw), cur)  # re-fitted, still > 20 % off
    assert ctl.refits == 2 and ctl.fallback and ctl.fallbacks == 1
    # while the model is not trusted, the measured rule decides: over the SLO -> the busier side grows
    got = ctl.decide(
        window(tpot_mean_s=3 * raw, tpot_p90_s=3 * SLO, violations=0.9, attention_util=[0.2], expert_util=[0.9] * 6),
        cur,
    )
    assert (got.attention, got.experts) == (1, 7) and ctl.sides["experts"].last.reason == "up:measured"
    # a window within 20 % of the (re-fitted) prediction ends the fallback
    ctl.decide(window(tpot_mean_s=ctl.model.tpot_disaggregated(64, CONTEXT, 1, 6), tpot_p90_s=0.5 * SLO), cur)
    assert not ctl.fallback and ctl.fallbacks == 1


def test_window_meter_weights_tokens_and_counts_violations():
    m = WindowMeter(slo_tpot_s=0.1, start=0.0)
    m.observe(0.05, decoded=[1, 1, 1], contexts=[10, 20, 30])  # 3 tokens at 50 ms
    m.observe(0.3, decoded=[2], contexts=[40])  # one request, 2 tokens in a 300 ms step: 150 ms each
    w = m.close(10.0, arrivals=5, output_tokens=20)
    assert w.tokens == 5 and w.tpot_mean_s == pytest.approx((3 * 0.05 + 2 * 0.15) / 5)
    assert w.tpot_p90_s == pytest.approx(0.15) and w.violations == pytest.approx(0.4)
    assert w.batch == 2.0 and w.decode_steps == 2 and w.load.rate == pytest.approx(0.5)
    assert m.close(20.0, 0, 1).tokens == 0  # a new window


class Clocked:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _out(rid, prompt, tokens, delta, ttft=None):
    return RequestOutput(rid, prompt, tokens, "", delta, "", None, False, None, "be", ttft=ttft)


def test_the_hook_measures_steps_queues_and_instances_and_exports_metrics():
    """Through the step hook: per-token TPOT from decode steps (first tokens are not decode tokens),
    time to first token, waiting requests, KV use per attention instance and activated replicas per
    expert instance; then ``jaxmoe_tpot_predicted_seconds`` / ``jaxmoe_tpot_measured_seconds`` and
    the fallback counter on the Prometheus page, through ``EngineStats`` and ``ServerMetrics``."""
    from jaxmoe.engine.stats import EngineStats
    from server.metrics import ServerMetrics

    bm = BlockManager(num_blocks=16, block_size=4, num_partitions=2)
    seqs = [Sequence(f"r{i}", [1, 2, 3]) for i in range(3)]
    bm.allocate(seqs[0], 12, partition=0)  # 3 of partition 0's 8 blocks
    bm.allocate(seqs[1], 4, partition=1)
    bm.allocate(seqs[2], 4, partition=1)
    from jaxmoe.engine.sequence import SequenceStatus

    for s in seqs:
        s.status = SequenceStatus.RUNNING
    stats = {"num_waiting": 2, "num_running": 3, "kv_utilization": 5 / 16, "kv_free_blocks": 11}
    stats.update(steps=4, admitted=5, rejected=0, aborted=0, finished=0, policy_errors=0, num_preempted=0)
    scheduler = types.SimpleNamespace(
        num_admitted=5,
        num_waiting=2,
        running=seqs,
        sequences=lambda: seqs,
        stats=lambda: stats,
        queue_lengths=lambda: {"be_decode": 3},
        preemptions={},
    )
    executor = types.SimpleNamespace(
        num_attention=2,
        num_expert_instances=6,
        slots_per_instance=SLOTS,
        activated_per_instance=lambda: {1: [9, 18, 27, 0, 9, 9], 2: [9, 0, 27, 0, 9, 9]},
        expert_activation_counts=lambda: None,
    )
    engine = types.SimpleNamespace(
        executor=executor,
        scheduler=scheduler,
        block_manager=bm,
        last_step_ran=True,
        hooks=[],
        layer_hook=None,
    )
    clock = Clocked()
    ctl = controller()
    scaler = Autoscaler(engine, ctl, interval_s=10.0, clock=clock, rescaler=FakeRescaler(0))
    engine.hooks.append(scaler)
    assert isinstance(scaler, ReportsStats) and ctl.current == Layout(8, 2, 6)
    for step in range(5):
        scaler.before_step(engine)
        clock.t += 0.04
        outs = [_out("r0", [1, 2, 3], list(range(step + 2)), [step])]  # decoding
        outs.append(_out(f"new{step}", [4, 5], [7], [7], ttft=0.5))  # its first token: not decode
        scaler.after_step(engine, outs)
    assert not scaler.decisions
    meter = scaler.meter
    assert meter.partial_p90() == (pytest.approx(0.04), 5.0)
    clock.t = 10.0
    scaler.before_step(engine)
    scaler.after_step(engine, [])  # an empty step still closes the interval
    d = scaler.decisions[-1]
    w = d.window
    assert w.tokens == 5 and w.tpot_mean_s == pytest.approx(0.04) and w.ttft_p90_s == pytest.approx(0.5)
    assert w.batch == 1 and w.waiting == 2 and w.arrivals == 0
    assert w.attention_util == [pytest.approx(3 / 8), pytest.approx(2 / 8)]
    assert w.expert_util == pytest.approx([9 / 27, 9 / 27, 1.0, 0.0, 9 / 27, 9 / 27])
    snap_stats = scaler.stats()
    assert snap_stats["running_per_instance"] == [1, 2]
    assert snap_stats["tpot_measured_s"] == pytest.approx(0.04)
    predicted = ctl.model.raw_tpot(1, w.context, 2, 6)
    assert snap_stats["tpot_predicted_s"] == pytest.approx(predicted)
    assert ctl.refits == (abs(predicted - 0.04) / 0.04 > 0.2)

    snap = EngineStats().snapshot(engine, in_flight=3, step_errors=0)
    assert snap["autoscale"]["tpot_measured_s"] == pytest.approx(0.04)
    metrics = ServerMetrics()
    metrics.watch(types.SimpleNamespace(snapshot=lambda: snap, compiles_after_warmup=None))
    page = metrics.render().decode()
    assert f"jaxmoe_tpot_measured_seconds {0.04}" in page
    assert "jaxmoe_tpot_predicted_seconds " in page
    assert "jaxmoe_autoscale_model_fallbacks_total 0.0" in page
    assert 'jaxmoe_autoscale_instance_utilization{instance="1",side="attention"} 0.25' in page


def test_urgent_decision_before_the_interval_when_the_window_violates():
    """Checked every ``check_s``: a window already over the SLO decides before the interval ends."""
    ctl = controller()
    clock = Clocked()
    engine = SimEngine(PerfModel(), 1, 6, lambda b, a, e: 0.1)
    scaler = Autoscaler(engine, ctl, interval_s=PAPER_INTERVAL_S, clock=clock, rescaler=FakeRescaler(0))
    clock.t = scaler.check_s - 1
    scaler.meter.observe(2 * SLO, [1] * 32, [CONTEXT], steps=100)
    assert scaler.tick() is None  # before the first check
    clock.t = scaler.check_s
    d = scaler.tick()
    assert d is not None and d.urgent and d.started and d.layout.gpus > 7
    assert math.isclose(d.window.duration, scaler.check_s)


@pytest.mark.slow
def test_a_real_engine_feeds_the_loop(checkpoint_dir):
    """On the 8-device CPU mesh (2 attention, 6 expert instances): the hook counts every decode token
    of real requests, times them, and reads KV use per attention partition and activated replicas
    per expert instance from the executor; the decision compares the roofline's prediction with it."""
    from jaxmoe import LLM, SamplingParams
    from jaxmoe.janus.scaling.autoscale import attach

    llm = LLM(
        checkpoint_dir("mixtral"),
        mesh="meshes/cpu-8.yaml",
        dtype="float32",
        num_blocks=64,
        block_size=8,
        max_num_seqs=4,
        max_prefill_chunk=16,
        max_batch_tokens=32,
    )
    engine = llm.engine
    scaler = attach(engine, slo_tpot_s=10.0, interval_s=3600)
    for i in range(3):
        engine.add_request([5 + i, 9, 11, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(200):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work() and not scaler.decisions
    d = scaler.decide()
    w = d.window
    assert w.tokens == 3 * 7  # 8 tokens each, the first one from the prefill
    assert w.tpot_mean_s > 0 and w.tpot_p90_s >= w.tpot_mean_s * 0.5  # compiling steps count too
    assert 1 <= w.batch <= 3 and w.context > 4 and w.ttft_p90_s is not None and w.arrivals == 3
    assert len(w.attention_util) == 2 and max(w.attention_util) > 0
    assert w.expert_util is not None and len(w.expert_util) == 6 and 0 < max(w.expert_util) <= 1
    stats = scaler.stats()
    assert stats["tpot_measured_s"] == pytest.approx(w.tpot_mean_s) and stats["tpot_predicted_s"] > 0
    assert (stats["attention"], stats["experts"]) == (2, 6) and d.layout in scaler.controller.layouts


@pytest.mark.parametrize("fallback", [False, True])
def test_at_the_device_limit_a_violation_never_shrinks_the_layout(fallback):
    """8 devices hold 1A6E, 1A7E and 2A6E of DeepSeek-V2: violated on 2A6E, neither side can grow, so
    the layout stays (no request that the devices cannot hold turns into a smaller layout)."""
    ctl = ClosedLoopController(PerfModel(), layouts_that_fit(8, 160, SLOTS), SLO)
    assert {lay.name for lay in ctl.layouts} == {"1A6E", "1A7E", "2A6E"}
    ctl.fallback = fallback
    ctl._gap_windows = 5 if fallback else 0
    cur = Layout(8, 2, 6)
    raw = ctl.model.raw_tpot(64, CONTEXT, 2, 6)
    bad = window(tpot_mean_s=raw * (3 if fallback else 1.1), tpot_p90_s=3 * SLO, violations=0.8, expert_util=[1.0] * 6)
    assert ctl.decide(bad, cur) == cur


@pytest.mark.slow
@pytest.mark.parametrize(
    "batch, context, grows, holds",
    [(256, 4000, "attention", "experts"), (64, 144, "experts", "attention")],
)
def test_each_sub_cluster_controller_grows_its_own_side(batch, context, grows, holds):
    """Long contexts make attention the larger share of the step (its controller adds instances, the
    expert controller holds); short contexts at batch 64 make it the experts'. The measured TPOT
    matches the (re-fitted) model, so the model ranks the counts (reason ``up:slo``)."""
    ctl = controller()
    ctl.model.factor = 1.9 if grows == "experts" else 1.0
    shares = ctl.model.shares(batch, context, 1, 6)
    assert shares[grows] > shares[holds]
    mean = ctl.model.tpot_disaggregated(batch, context, 1, 6)
    w = window(batch=float(batch), context=float(context), tpot_mean_s=mean, tpot_p90_s=1.2 * SLO, violations=0.3)
    got = ctl.decide(w, Layout(7, 1, 6))
    assert ctl.refits == 0
    assert ctl.sides[grows].last.reason == "up:slo" and ctl.sides[holds].last.reason == "hold"
    count = {"attention": got.attention, "experts": got.experts}
    assert (
        count[grows] > {"attention": 1, "experts": 6}[grows] and count[holds] == {"attention": 1, "experts": 6}[holds]
    )
    assert ctl.meets(got.attention, got.experts, ctl.demand(w))  # the least count predicted to recover
    smaller = dict(count, **{grows: count[grows] - 1})
    assert not ctl.meets(smaller["attention"], smaller["experts"], ctl.demand(w))
