"""The one place an engine is put together: ``build_engine(RuntimeConfig)``.

``RuntimeConfig`` holds every setting in sections: the engine (``EngineConfig``: KV cache, batch
budget, policy, expert-FFN form), the executor (a mesh file for the disaggregated executor, its
options) and one section per paper (``janus``, ``findep``, ``brownout``, ``qllm``). ``build_engine``
loads the model, builds the executor (monolithic, or disaggregated with a mesh file) and plugs the
features into the core through its declared seams: step hooks (live re-scaling, the placement
controller, SALC, the autoscaler), the layer hook (QLLM's layer-level preemption), the expert
routing (BrownoutServe's Algorithm 1) and the pipeline chooser (FinDEP). ``LLM``, ``jaxmoe serve``
and the profiling commands all build their engines here.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from jaxmoe.brownout.config import BrownoutConfig, SALCConfig
from jaxmoe.checkpoint.model import generation_config, load_model, model_dir
from jaxmoe.compilation import enable_persistent_cache
from jaxmoe.config import ModelConfig
from jaxmoe.engine.config import EngineConfig
from jaxmoe.engine.engine import LLMEngine
from jaxmoe.models.routing import TopKRouting, extra_experts
from jaxmoe.pallas_kernels.platform import target_platform
from jaxmoe.quantization import is_quantized_tree
from jaxmoe.runtime.monolithic import MonolithicExecutor

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class QLLMConfig:
    """QLLM: layer-level preemption of best-effort steps, and per-expert queues."""

    # latency-sensitive work may join (or run between) the layers of a BE step; None: where it applies
    # (``preempts``), True / False: as asked
    layer_preemption: bool | None = None
    expert_queues: int = 0  # serve each MoE layer's experts in this many rounds (needs layer_preemption; 0: off)
    max_paused_state_bytes: int | None = None  # a step whose paused state is bigger is not paused (None: any)
    ls_merge: bool = True  # LS work joins a paused BE step at a layer boundary (False: runs as a step of its own)
    # the merge's cost model: a merged call may hold at most max(this, the LS work's own call's) token
    # slots (rows x token bucket), else the LS work runs nested (``qllm.layer_preemption``); None: no limit
    ls_merge_tokens: int | None = 16

    def __post_init__(self):
        q = self.expert_queues
        if not isinstance(q, int) or isinstance(q, bool) or q < 0:
            raise ValueError(f"expert_queues must be a non-negative integer, got {q!r}")
        if q and self.layer_preemption is False:
            raise ValueError("expert_queues needs layer_preemption (its rounds are pause points of a BE step)")
        m = self.ls_merge_tokens
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"ls_merge_tokens must be a positive integer or None, got {m!r}")
        if self.layer_preemption not in (None, True, False):
            raise ValueError(f"layer_preemption must be True, False or None (auto), got {self.layer_preemption!r}")

    def preempts(self, config: RuntimeConfig) -> bool:
        """Whether the engine gets layer-level preemption: as asked, else (None) on with expert queues
        (their rounds are its pause points) and on the monolithic executor (no mesh file: where its
        cost when nothing preempts measured within 2 % of the fused step before the pause point after
        the last layer, over it since: ``bench/results/2026-11-28-qllm3.md``; ``bench/qllm.py``,
        BENCHMARKS.md), except in deterministic mode (one fixed-shape call per step) and with async
        scheduling (a step that may pause runs synchronously). Off by default
        on a mesh file: the disaggregated executor's cost is not measured, and across processes it
        is refused (``server.multihost``)."""
        if self.layer_preemption is not None:
            return self.layer_preemption
        if self.expert_queues:
            return True
        # async scheduling overlaps only steps that no pause point may stop (``engine.engine``)
        return config.mesh is None and not config.engine.deterministic and not config.engine.async_scheduling


@dataclasses.dataclass(frozen=True)
class JanusConfig:
    """JANUS's control plane on a mesh-file engine (live re-scaling is always attached there)."""

    rebalance_every: int = 0  # re-place expert replicas from recent activations every N steps (0: never)
    autoscale_slo_tpot_s: float | None = None  # the autoscaler's TPOT SLO (None: no autoscaler)
    autoscale_interval_s: float = 30.0
    scaling_profile: str | None = None  # a fitted performance model (``jaxmoe scaling-profile``)


@dataclasses.dataclass(frozen=True)
class FinDEPConfig:
    """FinDEP: the disaggregated step's schedule."""

    pipeline: Any = None  # "sequential" (None), "pppipe", "findep" or {"order", "r1", "r2"}
    pipeline_profile: Any = None  # a ``jaxmoe profile`` JSON for "pppipe" / "findep"


@dataclasses.dataclass(frozen=True)
class BrownoutSection:
    """BrownoutServe: brownout routing over united experts, and SALC moving its threshold."""

    brownout: BrownoutConfig | None = None
    salc: SALCConfig | None = None
    from_mesh_file: bool = True  # without ``brownout``, the mesh file's ``brownout:`` section decides

    def resolve(self, mesh) -> tuple[BrownoutConfig | None, SALCConfig | None]:
        if self.brownout is not None or not self.from_mesh_file or mesh is None:
            return self.brownout, self.salc
        from jaxmoe.brownout.config import mesh_brownout

        settings = mesh_brownout(mesh)
        return (None, None) if settings is None else (settings.brownout(), settings.salc_config())


SECTIONS = {"engine": EngineConfig, "janus": JanusConfig, "findep": FinDEPConfig, "qllm": QLLMConfig}


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    model: str = "demo"  # a built-in name or a checkpoint directory
    dtype: Any = None  # the parameters' dtype (None: the checkpoint's)
    mesh: Any = None  # a mesh file (or ``ClusterSpec``): the disaggregated executor; None: monolithic
    quantization: str | None = None  # "int8" | "fp8": routed expert weights quantized on load (None: as stored)
    quantize_attention: bool = False  # with ``quantization``: the attention projections too
    executor: dict = dataclasses.field(default_factory=dict)  # DisaggregatedExecutor options
    engine: EngineConfig = EngineConfig()
    janus: JanusConfig = JanusConfig()
    findep: FinDEPConfig = FinDEPConfig()
    brownout: BrownoutSection = BrownoutSection()
    qllm: QLLMConfig = QLLMConfig()

    @classmethod
    def from_kwargs(
        cls,
        model="demo",
        *,
        dtype=None,
        mesh=None,
        quantization=None,
        quantize_attention=False,
        executor_kwargs=None,
        brownout=None,
        salc=None,
        **kw,
    ):
        """Flat keyword arguments (``LLM``'s) sorted into their sections by name; a ``TypeError`` names
        one that no section has."""
        fields = {name: {} for name in SECTIONS}
        for key, value in kw.items():
            owner = next((n for n, c in SECTIONS.items() if key in {f.name for f in dataclasses.fields(c)}), None)
            if owner is None:
                raise TypeError(f"unknown setting {key!r}")
            fields[owner][key] = value
        return cls(
            model=str(model),
            dtype=dtype,
            mesh=mesh,
            quantization=quantization,
            quantize_attention=quantize_attention,
            executor=dict(executor_kwargs or {}),
            brownout=BrownoutSection(brownout, salc),
            **{name: SECTIONS[name](**values) for name, values in fields.items()},
        )


def deterministic_expert_impl(cfg: ModelConfig, params: dict, ec, brownout=None) -> str:
    """The expert-FFN form of ``ec``'s executor: in deterministic mode "auto" is the batch-invariant CPU
    kernels (``cpu_kernel_invariant``: the ordinary bucketed shapes) where they take the model, else the
    fixed-shape ``dense`` form; elsewhere ``ec.expert_impl`` as it is."""
    if not ec.deterministic:
        return ec.expert_impl
    from jaxmoe.models.transformer import invariant_unsupported

    reason = invariant_unsupported(cfg)
    if reason is None and is_quantized_tree(params):
        reason = "quantized weights are dequantized into XLA matmuls"
    if reason is None and brownout is not None:
        reason = "brownout routing"
    if ec.expert_impl == "cpu_kernel_invariant" and reason is not None:
        raise ValueError(f"expert_impl 'cpu_kernel_invariant' cannot run this model: {reason}")
    if ec.expert_impl == "auto":
        return "cpu_kernel_invariant" if reason is None and target_platform() == "cpu" else "dense"
    return ec.expert_impl


def build_executor(
    cfg: ModelConfig,
    params: dict,
    config: RuntimeConfig,
    brownout: BrownoutConfig | None = None,
    release_params: bool = False,
):
    """Monolithic executor by default; with a mesh file, the disaggregated one. The expert routing is
    the router's top-k, or BrownoutServe's Algorithm 1 with ``brownout``; QLLM's per-expert queues
    give the executor its expert rounds; FinDEP's pipeline chooser picks the disaggregated
    step's schedule when ``config.findep`` names one. ``release_params``: the caller gives ``params``
    up, the monolithic executor drops its per-layer arrays as it stacks them (start-up memory)."""
    ec, findep = config.engine, config.findep
    num_slots = ec.num_blocks * ec.block_size
    if config.mesh is None and findep.pipeline not in (None, "sequential"):
        raise ValueError(
            f"pipeline {findep.pipeline!r}: pipelined schedules run on a disaggregated mesh; give mesh=FILE"
        )
    routing, routing_state = TopKRouting(), None
    if brownout is not None:
        from jaxmoe.brownout.routing import routing_for

        routing, routing_state = routing_for(brownout)
    rounds = None
    if config.qllm.expert_queues:
        from jaxmoe.qllm.expert_queues import expert_bounds

        logical = cfg.moe.num_experts + extra_experts(routing, params)
        rounds = expert_bounds(logical, config.qllm.expert_queues)
    if config.mesh is None:
        return MonolithicExecutor(
            cfg,
            params,
            num_slots,
            ec.block_size,
            routing=routing,
            routing_state=routing_state,
            expert_impl=deterministic_expert_impl(cfg, params, ec, brownout),
            expert_rounds=rounds,
            pause_every=ec.pause_every or 1,
            release_params=release_params,
        )
    expert_impl = deterministic_expert_impl(cfg, params, ec, brownout)
    if ec.deterministic and expert_impl != "cpu_kernel_invariant":  # the fixed-shape dense form: monolithic only
        from jaxmoe.models.transformer import invariant_unsupported

        reason = invariant_unsupported(cfg) or ("brownout routing" if brownout is not None else None)
        raise ValueError(
            "deterministic mode with a mesh file runs on the batch-invariant CPU kernels (expert_impl "
            f"'cpu_kernel_invariant'), which cannot run here ({reason or f'expert_impl {ec.expert_impl!r}'}); "
            "drop the mesh file to run its fixed-shape form on the monolithic executor"
        )
    if config.qllm.expert_queues and (findep.pipeline not in (None, "sequential") or findep.pipeline_profile):
        raise ValueError(
            "expert_queues (QLLM per-expert queues) runs with the sequential schedule only: drop pipeline / "
            "pipeline_profile (FinDEP's micro-batches and chunks have no pause points inside a MoE layer)"
        )
    from jaxmoe.runtime.disaggregated import DisaggregatedExecutor

    kwargs = {
        "expert_impl": expert_impl,
        "pause_every": ec.pause_every or 1,
        "routing": routing,
        "routing_state": routing_state,
        "expert_rounds": rounds,
        **config.executor,
    }
    executor = DisaggregatedExecutor(cfg, params, num_slots, ec.block_size, config.mesh, **kwargs)
    if findep.pipeline is not None or findep.pipeline_profile is not None:
        from jaxmoe.findep.online import pipeline_chooser

        dtype = np.dtype(params["embed"].dtype)
        executor.pipeline = pipeline_chooser(
            "sequential" if findep.pipeline is None else findep.pipeline,
            cfg,
            executor.sub.spec,
            str(dtype),
            dtype.itemsize,
            profile=findep.pipeline_profile,
            max_rows=ec.max_num_seqs,
            max_tokens=ec.max_batch_tokens,
        )
    return executor


# what a rescaled executor is built with too
RESCALE_EXECUTOR_KWARGS = ("replica_policy", "aebs_impl", "interpret")


def build_engine(config: RuntimeConfig) -> LLMEngine:
    """Load the model, build the executor, assemble the engine and attach the features ``config`` asks
    for. Compiled programs go to the persistent compilation cache (``jaxmoe.compilation``)."""
    enable_persistent_cache()
    cfg, params, tokenizer = load_model(config.model, config.dtype, config.quantization, config.quantize_attention)
    brownout, salc = config.brownout.resolve(config.mesh)
    if brownout is not None:
        from jaxmoe.brownout.united import attach

        params = attach(params, cfg, model_dir(config.model))
    executor = build_executor(cfg, params, config, brownout, release_params=True)
    engine = LLMEngine(cfg, executor, tokenizer, config.engine)
    engine.sampling_defaults = generation_config(config.model)  # what requests leave unset (else greedy)
    return attach_features(engine, config, salc)


def attach_features(engine: LLMEngine, config: RuntimeConfig, salc: SALCConfig | None = None) -> LLMEngine:
    """Plug the features ``config`` asks for into ``engine`` (``salc``: the resolved SALC settings)."""
    if config.qllm.preempts(config):
        from jaxmoe.qllm.layer_preemption import LayerPreemption

        # with a serving loop's poll, steps that do not pause run the same programs (``LLMEngine.poll``);
        # on by default (not asked for, no per-expert queues, no ``pause_every``), the pause granularity
        # is measured: pause points only where they cost within 2 % (``qllm.granularity``)
        qllm, every = config.qllm, config.engine.pause_every
        measured = every is None and qllm.layer_preemption is None and not qllm.expert_queues
        engine.layer_hook = LayerPreemption(
            qllm.max_paused_state_bytes, qllm.ls_merge, qllm.ls_merge_tokens, None if measured else every or 1
        )
    if config.mesh is not None:
        from jaxmoe.janus.live_rescale import LiveRescaler

        LiveRescaler.attach(engine, {k: v for k, v in config.executor.items() if k in RESCALE_EXECUTOR_KWARGS})
    if salc is not None:
        from jaxmoe.brownout.controller import BrownoutController

        BrownoutController.attach(engine, salc)
    janus = config.janus
    if janus.rebalance_every:
        from jaxmoe.janus.placement_controller import PlacementController

        PlacementController.attach(engine, janus.rebalance_every)
    if janus.autoscale_slo_tpot_s is not None:
        from jaxmoe.janus.scaling.autoscale import attach

        attach(engine, janus.autoscale_slo_tpot_s, janus.autoscale_interval_s, profile=janus.scaling_profile)
    return engine
