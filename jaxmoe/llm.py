"""The notebook API: ``LLM("path/or/demo").generate(prompts, SamplingParams(...))``.

``LLM`` takes ``build_engine``'s settings as flat keyword arguments (``jaxmoe.assembly.RuntimeConfig``
sorts them into their sections) and steps the engine until every prompt is done.
"""

from __future__ import annotations

import time

from typing import Sequence as Seq

from jaxmoe.assembly import RuntimeConfig, build_engine
from jaxmoe.checkpoint.model import generation_config, load_model
from jaxmoe.engine.engine import RequestOutput
from jaxmoe.janus.live_rescale import LiveRescaler, RescaleResult
from jaxmoe.sampling import SamplingParams

__all__ = ["LLM", "load_model"]


class LLM:
    """Offline generation over a batch of prompts, with continuous batching underneath."""

    def __init__(self, model="demo", **settings):
        """``settings``: ``dtype``, ``mesh`` (a mesh file: the disaggregated executor),
        ``executor_kwargs`` and any field of ``RuntimeConfig``'s sections by name: the engine's
        (``max_num_seqs``, ``num_blocks``, ``policy``, ``expert_impl``, ...), JANUS's
        (``rebalance_every``: re-place expert replicas from recent activations every that many steps),
        FinDEP's (``pipeline``: "sequential" (default), "pppipe", "findep" or {"order": "ASAS", "r1": 2,
        "r2": 4}; ``pipeline_profile``), QLLM's (``layer_preemption``, ``expert_queues``,
        ``max_paused_state_bytes``) and BrownoutServe's (``brownout``: a ``BrownoutConfig``, the model
        directory holding united experts, ``jaxmoe unite``; ``salc``; without them a mesh file's
        ``brownout:`` section decides)."""
        self.model = model
        self.config = RuntimeConfig.from_kwargs(model, **settings)
        self.engine_config = self.config.engine
        self.engine = build_engine(self.config)
        self.cfg, self.tokenizer = self.engine.cfg, self.engine.tokenizer

    def _hook(self, kind: type):
        return next((h for h in self.engine.hooks if isinstance(h, kind)), None)

    @property
    def brownout_controller(self):
        """SALC moving the brownout threshold (None: not attached)."""
        from jaxmoe.brownout.controller import BrownoutController

        return self._hook(BrownoutController)

    @property
    def controller(self):
        """The expert placement controller (None: not attached, ``rebalance_every=0``)."""
        from jaxmoe.janus.placement_controller import PlacementController

        return self._hook(PlacementController)

    @property
    def generation_config(self) -> dict:
        """The checkpoint's suggested sampling (``generation_config``), as ``SamplingParams`` keyword
        arguments; {} when it has none."""
        return generation_config(self.model)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` / ``chat`` use when given no ``SamplingParams`` (as vLLM): the
        checkpoint's generation_config, else greedy."""
        return SamplingParams(**self.generation_config)

    @property
    def executor(self):
        """The executor serving now (``rescale`` replaces it)."""
        return self.engine.executor

    @property
    def params(self) -> dict:
        return self.executor.params

    def rescale(
        self, attention: int, experts: int, slots_per_instance: int | None = None, timeout: float = 600.0
    ) -> RescaleResult:
        """Change the number of attention and expert instances (mesh file engines): returns when the
        new layout serves, with the stall it caused (``janus.live_rescale``: build in the background,
        swap at a step boundary). For an idle engine (between ``generate`` calls). Raises
        ``RescaleError`` naming a value that does not fit."""
        rescaler = LiveRescaler.of(self.engine)
        if self.engine.has_work():
            raise RuntimeError(
                "requests are in flight on this engine: call LiveRescaler.of(llm.engine).start(...) and keep stepping it"
            )
        job = rescaler.start(attention, experts, slots_per_instance)
        if job.agreed:  # jax.distributed: every process calls this at the same point and asks together
            deadline = time.monotonic() + timeout
            while not job.done():  # each call runs the next build unit, then agrees
                if time.monotonic() > deadline:  # the same on every process only if they all give up
                    raise TimeoutError(f"rescale to {job.target} not built after {timeout}s")
                if not rescaler.apply() and job.units is None:
                    time.sleep(0.05)  # every unit ran: the compiles go on in the background
        elif not job.wait_ready(timeout):
            raise TimeoutError(f"rescale to {job.target} not built after {timeout}s")
        rescaler.apply()  # idle: the job is done once swapped
        return job.result()

    def load_united_experts(self, directory) -> dict:
        """BrownoutServe's Experts Loader: serve the united experts of ``directory`` (``jaxmoe unite``
        of this model, any k) instead of the current ones from the next step on, without a restart
        (``jaxmoe.brownout.loader``; monolithic executor). Call it between steps: between ``generate``
        calls, or between ``llm.engine.step()`` calls with requests in flight (they go on)."""
        from jaxmoe.brownout.loader import load_united_experts

        return load_united_experts(self.engine, directory)

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        priority: str = "be",
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order, one
        ``RequestOutput`` per prompt whose ``outputs`` hold its ``n`` completions (vLLM). With
        ``n`` > 1 or ``best_of``, each completion is its own request sharing the prompt
        (``SamplingParams.for_index``); of ``best_of`` the ``n`` with the highest cumulative logprob
        are kept, best first. The request's own fields (``text``, ``token_ids``, ...) are those of
        ``outputs[0]``."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for p, s in zip(prompts, sampling_params):
                ids.append([self.engine.add_request(p, s.for_index(i), priority) for i in range(s.num_sequences)])
        except Exception:
            for rid in (r for group in ids for r in group):  # all or nothing
                self.engine.abort(rid)
            raise
        final = self.engine.run_until_done()
        return [_merge([final[r] for r in group], s, p) for group, s, p in zip(ids, sampling_params, prompts)]

    def chat(
        self,
        messages: list[dict] | Seq[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} messages: one ``RequestOutput``)
        or to a list of conversations (a list of outputs, in order, as vLLM's ``LLM.chat``), each
        rendered with the checkpoint's chat template."""
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else list(messages)
        prompts = [
            self.tokenizer.encode(self.tokenizer.apply_chat_template(c, add_generation_prompt=True))
            for c in conversations
        ]
        outs = self.generate(prompts, sampling_params)
        return outs[0] if one else outs


def _merge(outs: list[RequestOutput], sampling: SamplingParams, prompt) -> RequestOutput:
    """One prompt's request outputs as one ``RequestOutput`` with ``n`` completions."""
    if len(outs) > sampling.n:  # best_of: keep the n most likely
        outs = sorted(outs, key=lambda o: -(o.cumulative_logprob or 0.0))[: sampling.n]
    first = outs[0]
    first.prompt = prompt if isinstance(prompt, str) else None
    if len(outs) > 1 or sampling.num_sequences > 1:
        first.outputs = [o.completion(i) for i, o in enumerate(outs)]
    return first
