"""The notebook API: ``LLM("path/or/demo").generate(prompts, SamplingParams(...))``.

``load_model`` resolves a model name: ``demo`` / ``tiny-random`` (built in), a directory converted by jaxmoe (Orbax),
or a Hugging Face checkpoint directory (config.json + safetensors + tokenizer.json).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence as Seq

import jax.numpy as jnp
import numpy as np

from jaxmoe.checkpoint import is_converted, load_params, restore_converted
from jaxmoe.compilation import enable_persistent_cache
from jaxmoe.config import ModelConfig, load_config
from jaxmoe.demo import DEMO_DIR, TINY_RANDOM, demo_config, demo_params
from jaxmoe.engine.engine import EngineConfig, LLMEngine, RequestOutput
from jaxmoe.engine.rescale import RescaleResult
from jaxmoe.quantization import check_method, is_quantized_tree, quantize_params
from jaxmoe.sampling import SamplingParams
from jaxmoe.runtime.monolithic import MonolithicExecutor
from jaxmoe.tokenizer import ByteTokenizer, load_tokenizer


def load_model(
    model: str | Path, dtype=None, quantization: str | None = None, quantize_attention: bool = False
) -> tuple[ModelConfig, dict, object]:
    """(config, params, tokenizer) for a built-in name (``demo``: the trained demo model shipped in
    ``jaxmoe/assets/demo``; ``tiny-random``: a tiny random-weight model with the byte tokenizer, for
    tests), a jaxmoe-converted directory or an HF checkpoint. ``quantization`` ("int8" / "fp8"): the
    routed expert weights (with ``quantize_attention`` the attention projections too) are quantized on
    load (``jaxmoe.quantization``)."""
    check_method(quantization)
    if quantize_attention and quantization is None:
        raise ValueError("quantize_attention needs quantization='int8' or 'fp8'")
    cfg, params, tokenizer = _load_model(model, dtype)
    return cfg, quantize_params(params, quantization, quantize_attention), tokenizer


def _load_model(model: str | Path, dtype=None) -> tuple[ModelConfig, dict, object]:
    if str(model) == TINY_RANDOM:
        cfg = demo_config()
        return cfg, demo_params(cfg, dtype=jnp.dtype(dtype or jnp.float32)), ByteTokenizer()
    path = DEMO_DIR if str(model) == "demo" else Path(model)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {str(model)!r} is neither a built-in name ('demo', '{TINY_RANDOM}') nor a checkpoint directory"
        )
    if is_converted(path):
        params, cfg = restore_converted(path)
    else:
        cfg = load_config(path)
        params = load_params(path, cfg, dtype=dtype)
    tokenizer = load_tokenizer(path) if (path / "tokenizer.json").exists() else ByteTokenizer()
    return cfg, params, tokenizer


def build_executor(
    cfg: ModelConfig,
    params: dict,
    engine_config: EngineConfig,
    mesh=None,
    executor_kwargs: dict | None = None,
    brownout=None,
    pipeline=None,
    pipeline_profile=None,
):
    """Monolithic executor by default; with a mesh file, the disaggregated one.

    ``executor_kwargs`` go to ``DisaggregatedExecutor`` (replica_policy, expert_impl, placement,
    pipeline, ...). ``brownout``: a ``BrownoutConfig`` (either executor).
    ``pipeline``: the disaggregated step's schedule, "sequential" (the default), "pppipe", "findep" or
    a dict {"order", "r1", "r2"}; ``pipeline_profile``: a ``jaxmoe profile`` JSON for "pppipe" /
    "findep" (``jaxmoe.planning.online``).
    """
    num_slots = engine_config.num_blocks * engine_config.block_size
    if mesh is None and pipeline not in (None, "sequential"):
        raise ValueError(f"pipeline {pipeline!r}: pipelined schedules run on a disaggregated mesh; give mesh=FILE")
    if mesh is None:
        return MonolithicExecutor(
            cfg,
            params,
            num_slots,
            engine_config.block_size,
            brownout=brownout,
            expert_impl=engine_config.expert_impl,
            expert_queues=engine_config.expert_queues,
            pause_every=engine_config.pause_every,
        )
    if is_quantized_tree(params):
        raise ValueError("quantization (int8 / fp8 weights) runs on the monolithic executor only (no mesh file)")
    if engine_config.expert_queues:
        raise ValueError("expert_queues (QLLM per-expert queues) runs on the monolithic executor only (no mesh file)")
    from jaxmoe.runtime.disaggregated import DisaggregatedExecutor

    kwargs = {
        "expert_impl": engine_config.expert_impl,
        "pause_every": engine_config.pause_every,
        "brownout": brownout,
        **(executor_kwargs or {}),
    }
    executor = DisaggregatedExecutor(cfg, params, num_slots, engine_config.block_size, mesh, **kwargs)
    if pipeline is not None or pipeline_profile is not None:
        from jaxmoe.planning.online import pipeline_chooser

        dtype = np.dtype(params["embed"].dtype)
        executor.pipeline = pipeline_chooser(
            "sequential" if pipeline is None else pipeline,
            cfg,
            executor.sub.spec,
            str(dtype),
            dtype.itemsize,
            profile=pipeline_profile,
            max_rows=engine_config.max_num_seqs,
            max_tokens=engine_config.max_batch_tokens,
        )
    return executor


class LLM:
    """Offline generation over a batch of prompts, with continuous batching underneath."""

    def __init__(
        self,
        model: str | Path = "demo",
        *,
        dtype=None,
        quantization: str | None = None,
        quantize_attention: bool = False,
        mesh=None,
        executor_kwargs: dict | None = None,
        rebalance_every: int = 0,
        brownout=None,
        pipeline=None,
        pipeline_profile=None,
        **engine_kwargs,
    ):
        """``rebalance_every``: with a mesh, re-place the expert replicas from recent activations
        every that many steps (``runtime.controller.PlacementController``, JANUS Algorithm 2).
        ``brownout``: a ``BrownoutConfig`` (BrownoutServe); the model directory must hold united
        experts (``jaxmoe unite``); ``llm.executor.brownout_threshold`` may change between steps.
        Without it, a mesh file's ``brownout:`` section turns brownout on (its start threshold and
        mode) and, with ``salc: true``, attaches SALC (``llm.brownout_controller``).
        ``pipeline`` / ``pipeline_profile`` (with a mesh): the step's schedule, "sequential" (default),
        "pppipe", "findep" or {"order": "ASAS", "r1": 2, "r2": 4}, and the profile the solver uses
        (``build_executor``, ``jaxmoe.planning.online``).
        ``quantization`` ("int8" / "fp8", ``quantize_attention``): weights quantized on load (``load_model``).
        Compiled programs go to the persistent compilation cache (``jaxmoe.compilation``)."""
        enable_persistent_cache()
        self.model = model
        self.cfg, params, self.tokenizer = load_model(model, dtype, quantization, quantize_attention)
        salc = None
        if brownout is None and mesh is not None:
            from jaxmoe.mesh import mesh_brownout

            settings = mesh_brownout(mesh)
            if settings is not None:
                brownout, salc = settings.brownout(), settings.salc_config()
        if brownout is not None:
            from jaxmoe.brownout.united import attach

            params = attach(params, self.cfg, DEMO_DIR if str(model) == "demo" else model)
        self.engine_config = EngineConfig(**engine_kwargs)
        executor = build_executor(
            self.cfg, params, self.engine_config, mesh, executor_kwargs, brownout, pipeline, pipeline_profile
        )
        self.engine = LLMEngine(self.cfg, executor, self.tokenizer, self.engine_config)
        keep = ("replica_policy", "aebs_impl", "interpret")  # what a rescaled executor is built with too
        self.engine.rescaler.executor_kwargs = {k: v for k, v in (executor_kwargs or {}).items() if k in keep}
        self.brownout_controller = None
        if salc is not None:
            from jaxmoe.brownout.controller import BrownoutController

            self.brownout_controller = BrownoutController.attach(self.engine, salc)
        self.controller = None
        if rebalance_every:
            from jaxmoe.runtime.controller import PlacementController

            self.controller = PlacementController.attach(self.engine, rebalance_every)

    @property
    def generation_config(self) -> dict:
        """The checkpoint's suggested sampling (``generation_config.json``: temperature, top_p, top_k
        when ``do_sample``), as ``SamplingParams`` keyword arguments; {} when it has none."""
        path = DEMO_DIR if str(self.model) == "demo" else Path(self.model)
        try:
            conf = json.loads((path / "generation_config.json").read_text())
        except (OSError, ValueError):
            return {}
        if not conf.get("do_sample"):
            return {}
        return {k: conf[k] for k in ("temperature", "top_p", "top_k") if isinstance(conf.get(k), (int, float))}

    @property
    def executor(self):
        """The executor serving now (``rescale`` replaces it)."""
        return self.engine.runner.executor

    @property
    def params(self) -> dict:
        return self.executor.params

    def rescale(
        self, attention: int, experts: int, slots_per_instance: int | None = None, timeout: float = 600.0
    ) -> RescaleResult:
        """Change the number of attention and expert instances (mesh file engines): returns when the
        new layout serves, with the stall it caused (``engine.rescale``: build in the background,
        swap at a step boundary). For an idle engine (between ``generate`` calls). Raises ``RescaleError`` naming a value that does not fit."""
        if self.engine.has_work():
            raise RuntimeError(
                "requests are in flight on this engine: call llm.engine.rescale(...) and keep stepping it"
            )
        job = self.engine.rescale(attention, experts, slots_per_instance)
        if not job.wait_ready(timeout):
            raise TimeoutError(f"rescale to {job.target} not built after {timeout}s")
        self.engine.apply_rescale()  # idle: the job is done once swapped
        return job.result()

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        priority: str = "be",
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        ids = [self.engine.add_request(p, s, priority) for p, s in zip(prompts, sampling_params)]
        final = self.engine.run_until_done()
        return [final[i] for i in ids]

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([self.tokenizer.encode(prompt)], sampling_params)[0]
