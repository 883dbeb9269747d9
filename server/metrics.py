"""Prometheus metrics of one server instance (its own ``CollectorRegistry``, so several servers can
live in one process, e.g. in tests).

Per-request metrics are observed when a request finishes (``observe_finished``, the AsyncEngine's
``on_finish`` hook, so gRPC and HTTP requests count alike). Engine gauges are read at scrape time
from ``AsyncEngine.snapshot()`` (published by the engine thread after every step).

Names (all prefixed ``jaxmoe_``) are listed in docs/serving.md.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxmoe.compilation import compile_events
from jaxmoe.janus.live_rescale import LiveRescaler
from jaxmoe.engine.outputs import RequestOutput
from jaxmoe.engine.scheduler import PREEMPTION_LEVELS
from jaxmoe.server.layout import current_layout

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


# the prefix cache's counters: (metric, help, key of the engine's snapshot)
PREFIX_CACHE_COUNTERS = (
    (
        "jaxmoe_prefix_cache_queries",
        "Tokens of sequences looked up in the prefix cache when they started computing their KV",
        "prefix_cache_queries",
    ),
    (
        "jaxmoe_prefix_cache_hits",
        "Tokens whose KV came from the prefix cache (of jaxmoe_prefix_cache_queries_total)",
        "prefix_cache_hits",
    ),
    (
        "jaxmoe_prefix_cache_waits",
        "Steps a request without KV waited for a shared prefix a running prefill was computing",
        "prefix_cache_waits",
    ),
    (
        "jaxmoe_prefill_tokens",
        "Prompt (and recompute) tokens computed in prefill chunks (prefix-cache hits excluded)",
        "prefill_tokens",
    ),
)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "jaxmoe_time_to_first_token_seconds", "Time to first token", ["priority"], buckets=_TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "jaxmoe_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            ["priority"],
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "jaxmoe_requests_finished",
            "Requests that ended, by finish reason",
            ["priority", "finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "jaxmoe_requests_rejected", "Requests refused at admission", ["reason"], registry=r
        )  # invalid | overloaded (waiting queue full) | connections (HTTP connection limit) | unavailable
        self.prompt_tokens = Counter(
            "jaxmoe_prompt_tokens", "Prompt tokens of finished requests", ["priority"], registry=r
        )
        self.generation_tokens = Counter("jaxmoe_generation_tokens", "Generated tokens", ["priority"], registry=r)

    def watch(self, async_engine) -> None:
        """Export the engine gauges (queues, batch, KV, preemptions, expert activations)."""
        self.registry.register(_EngineCollector(async_engine))

    def observe_finished(self, out: RequestOutput) -> None:
        p = out.priority
        self.requests.labels(p, out.finish_reason or "unknown").inc()
        self.prompt_tokens.labels(p).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(p).inc(len(out.token_ids))
        if out.ttft is not None:
            self.ttft.labels(p).observe(out.ttft)
        if out.tpot is not None:
            self.tpot.labels(p).observe(out.tpot)

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and engine-side counters from the engine thread's latest snapshot."""

    def __init__(self, async_engine):
        self.async_engine = async_engine

    def describe(self):
        return []  # values are only known at scrape time

    def collect(self):
        snap = self.async_engine.snapshot()
        if not snap:
            return
        q = GaugeMetricFamily("jaxmoe_queue_length", "Requests in each QLLM queue", labels=["queue"])
        for name, n in snap["queues"].items():
            q.add_metric([name], n)
        yield q
        yield GaugeMetricFamily("jaxmoe_running_batch_size", "Sequences in the latest step", value=snap["num_running"])
        yield GaugeMetricFamily("jaxmoe_waiting_requests", "Accepted, never scheduled", value=snap["num_waiting"])
        yield GaugeMetricFamily("jaxmoe_inflight_requests", "Accepted, not finished", value=snap["in_flight"])
        yield GaugeMetricFamily(
            "jaxmoe_kv_block_utilization", "Fraction of KV blocks in use", value=snap["kv_utilization"]
        )
        yield GaugeMetricFamily("jaxmoe_kv_free_blocks", "Free KV blocks", value=snap["kv_free_blocks"])
        yield GaugeMetricFamily("jaxmoe_kv_blocks", "KV blocks in all", value=snap["num_blocks"])
        pre = CounterMetricFamily(
            "jaxmoe_preemptions",
            "Preemptions: at step boundaries (kind keep_kv, recompute) and between layers "
            "(kind pause: a paused request, QLLM layer-level)",
            labels=["kind", "level", "priority"],
        )
        for kind, per in snap["preemptions"].items():
            for prio, n in per.items():
                pre.add_metric([kind, PREEMPTION_LEVELS[kind], prio], n)
        yield pre
        layer_preemption = snap.get("layer_preemption") or {}  # QLLM's layer hook, when the engine has one
        yield CounterMetricFamily(
            "jaxmoe_pauses_over_budget",
            "Layer-level pauses refused because the step's state exceeded max_paused_state_bytes "
            "(the latency-sensitive work waited for the step boundary)",
            value=layer_preemption.get("pauses_over_budget", 0),
        )
        yield CounterMetricFamily(
            "jaxmoe_ls_merges",
            "Latency-sensitive requests merged into a running best-effort step at a pause point "
            "(QLLM's merge: they caught up to it, then shared the rest of the step; inside a MoE layer "
            "with per-expert queues their assignments were served ahead of the waiting ones)",
            value=layer_preemption.get("ls_merges", 0),
        )
        yield CounterMetricFamily(
            "jaxmoe_ls_merges_declined",
            "Merges of latency-sensitive work that QLLM's cost model declined because the merged call would "
            "pad it (a prompt joining a decode call); that work ran as a nested step, alone",
            value=layer_preemption.get("merges_declined", 0),
        )
        yield GaugeMetricFamily(
            "jaxmoe_paused_state_bytes_max",
            "The most device memory a paused step kept (hidden states, expert-queue state)",
            value=layer_preemption.get("paused_state_bytes_max", 0),
        )
        if layer_preemption.get("pause_every") is not None:  # None: not chosen yet (measured at warm-up)
            yield GaugeMetricFamily(
                "jaxmoe_pause_every",
                "Layer preemption: layers between two pause points of a best-effort step (0: step-level "
                "preemption, no granularity measured within its cost budget)",
                value=layer_preemption["pause_every"],
            )
        depth = layer_preemption.get("expert_queue_depth")
        if depth is not None:
            q = GaugeMetricFamily(
                "jaxmoe_expert_queue_depth",
                "Per-expert queues: assignments waiting at each expert when a step last paused inside a MoE layer",
                labels=["expert"],
            )
            for expert, n in enumerate(depth):
                q.add_metric([str(expert)], n)
            yield q
        engine = getattr(self.async_engine, "engine", None)  # the LLMEngine (None: a snapshot source alone)
        layout = None if engine is None else current_layout(engine)
        if layout is not None:  # read at scrape time: after a live rescale, the new layout
            yield GaugeMetricFamily("jaxmoe_attention_instances", "Attention instances serving now", value=layout[1])
            yield GaugeMetricFamily("jaxmoe_expert_instances", "Expert instances serving now", value=layout[2])
            rescaler = LiveRescaler.find(engine)
            if rescaler is not None:
                yield CounterMetricFamily("jaxmoe_rescales", "Live rescales done", value=len(rescaler.history))
        for name, help_text, key in PREFIX_CACHE_COUNTERS:
            yield CounterMetricFamily(name, help_text, value=snap.get(key, 0))
        yield GaugeMetricFamily(
            "jaxmoe_prefix_cache_blocks",
            "KV blocks in the prefix cache (held by a request or kept until memory is needed)",
            value=snap.get("prefix_cache_blocks", 0),
        )
        yield CounterMetricFamily("jaxmoe_engine_steps", "Engine steps", value=snap["steps"])
        yield CounterMetricFamily("jaxmoe_engine_step_errors", "Engine steps that raised", value=snap["step_errors"])
        yield CounterMetricFamily(
            "jaxmoe_policy_errors",
            "Scheduling-policy decisions that raised or were invalid (the default policy decided instead)",
            value=snap["policy_errors"],
        )
        report = None if engine is None else getattr(engine.executor, "op_impls", None)
        if callable(report):
            info = GaugeMetricFamily(
                "jaxmoe_op_impl", "The implementation each op runs (1 per op)", labels=["op", "impl"]
            )
            for op, impl in report().items():
                info.add_metric([op, impl], 1)
            yield info
        xla = compile_events()
        yield CounterMetricFamily("jaxmoe_xla_compiles", "XLA programs compiled by this process", value=xla["compiles"])
        yield CounterMetricFamily(
            "jaxmoe_xla_cache_loads", "XLA programs loaded from the persistent cache", value=xla["cache_hits"]
        )
        yield CounterMetricFamily(
            "jaxmoe_xla_compile_seconds", "Seconds spent compiling XLA programs", value=xla["compile_seconds"]
        )
        late = self.async_engine.compiles_after_warmup
        if late is not None:
            yield GaugeMetricFamily(
                "jaxmoe_compiles_after_warmup",
                "XLA programs compiled or loaded since warm-up ended (0: none while serving)",
                value=late,
            )
        brownout = snap.get("brownout")
        if brownout is not None:
            gauge = GaugeMetricFamily(
                "jaxmoe_brownout_threshold",
                "BrownoutServe threshold per phase: share of expert assignments kept by original experts",
                labels=["phase"],
            )
            for phase, value in brownout["threshold"].items():
                gauge.add_metric([phase], value)
            yield gauge
            p90 = GaugeMetricFamily(
                "jaxmoe_slo_p90_seconds", "P90 latency over the SLO analyzer's window", labels=["phase"]
            )
            for phase, value in brownout["p90"].items():
                if value is not None:
                    p90.add_metric([phase], value)
            yield p90
        yield from _autoscale_metrics(snap.get("autoscale"))
        used = snap.get("activated_experts")
        if used is not None:
            g = GaugeMetricFamily(
                "jaxmoe_activated_experts",
                "Distinct experts a step read, summed over MoE layers (kind original | united: brownout "
                "replaces groups of original experts by united ones), the last step sampled",
                labels=["kind"],
            )
            g.add_metric(["original"], used["original"])
            g.add_metric(["united"], used["united"])
            yield g
        counts = snap.get("expert_counts")
        if counts:
            act = CounterMetricFamily(
                "jaxmoe_expert_activations", "Tokens routed to each expert, per MoE layer", labels=["layer", "expert"]
            )
            for layer, row in counts:
                for expert, n in enumerate(row):
                    act.add_metric([str(layer), str(expert)], n)
            yield act


def _autoscale_metrics(scale: dict | None):
    """The closed scaling loop (``janus.scaling.autoscale.Autoscaler``), when the engine has one."""
    if scale is None:
        return
    for name, key, text in (
        ("jaxmoe_tpot_predicted_seconds", "tpot_predicted_s", "Model TPOT of the serving layout at the measured batch"),
        ("jaxmoe_tpot_measured_seconds", "tpot_measured_s", "Measured per-token decode time, last decision window"),
    ):
        if scale.get(key) is not None:
            yield GaugeMetricFamily(name, text + " (autoscaler)", value=scale[key])
    window = scale.get("window") or {}
    if window.get("tokens"):
        yield GaugeMetricFamily(
            "jaxmoe_autoscale_slo_violation_ratio",
            "Share of decode tokens over the TPOT SLO, last decision window",
            value=window["violations"],
        )
    yield CounterMetricFamily(
        "jaxmoe_autoscale_model_refits", "Performance-model re-fits (gap > 20 %)", value=scale.get("model_refits", 0)
    )
    yield CounterMetricFamily(
        "jaxmoe_autoscale_model_fallbacks",
        "Switches to the measured-only scaling rule (the model stayed > 20 % off after re-fits)",
        value=scale.get("model_fallbacks", 0),
    )
    inst = GaugeMetricFamily("jaxmoe_autoscale_instances", "Instances serving, per sub-cluster", labels=["side"])
    inst.add_metric(["attention"], scale["attention"])
    inst.add_metric(["experts"], scale["experts"])
    yield inst
    util = GaugeMetricFamily(
        "jaxmoe_autoscale_instance_utilization",
        "Per instance: attention KV blocks in use (now), expert replicas run of its slots (last window)",
        labels=["side", "instance"],
    )
    for side, values in (("attention", scale.get("attention_utilization")), ("experts", window.get("expert_util"))):
        for i, v in enumerate(values or []):
            util.add_metric([side, str(i)], v)
    yield util
