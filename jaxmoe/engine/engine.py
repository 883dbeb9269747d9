"""The step loop: schedule -> run the model (attention / experts) and sample -> postprocess -> hooks.

``LLMEngine.step`` is the whole data path of one iteration, in order:

1. ``Scheduler.schedule`` picks prefill chunks and decodes (priorities, KV blocks).
2. ``ModelRunner.run`` pads them into a batch and runs the executor — monolithic, or attention
   program -> transfer -> expert program -> transfer back per layer — then the sampler.
3. Stop conditions (EOS, stop tokens, stop strings) are checked, ``Scheduler.postprocess`` appends
   the tokens and frees the blocks of finished requests; one :class:`RequestOutput` per touched
   request is returned for streaming.
4. The step hooks run (``engine.hooks``: features plugged in between steps, e.g. live re-scaling
   or the expert placement controller); a ``LayerHook`` may pause a step between its layers.

Async scheduling (``EngineConfig.async_scheduling``, as vLLM's): step N+1 is scheduled and
dispatched before step N's sampled tokens are read, one step late (``_step_ahead``). Step N's
sequences are postprocessed at once with a placeholder token (``AHEAD``, so the scheduler counts
it and allocates its KV slot); a sequence that decodes on takes step N's sampled token on the
device as its input (``ModelRunner.launch``); then step N's tokens are read and its stops,
logprobs, detokenization and outputs done while step N+1 runs. A sequence that stops at step N
was computed once more in step N+1: that token is dropped, never emitted, and its KV slot lies past
every block the prefix cache holds (blocks are offered only up to ``num_computed``). Where the
host must see step N's token before step N+1 can be built, a step runs synchronously (step N read
first): rows with a grammar (structured output), logit bias or penalties (their token history),
prompt logprobs, a prefill chunk holding a placeholder (a recompute-preempted sequence); and step
hooks, a step a layer hook may pause (QLLM), deterministic mode's fixed-shape form (its
batch-invariant CPU kernels overlap), an executor that does not say it overlaps
(``overlaps_steps``: the disaggregated one) and multi-process serving. A step that fails on the
device fails all its requests (the synchronous loop isolates the failing ones).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import jax
import numpy as np

from jaxmoe.engine.block_manager import BlockManager
from jaxmoe.engine.buckets import ShapePlan, bucket
from jaxmoe.engine.config import DETERMINISTIC_ROW_TOKENS, EngineConfig
from jaxmoe.engine.hooks import LayerHook, StepHook
from jaxmoe.engine.model_runner import Launched, Merge, MergedRows, ModelRunner, Row
from jaxmoe.engine.outputs import RequestOutput, StepFailedError, TokenLogprob
from jaxmoe.engine.policies import make_policy
from jaxmoe.engine.prompt_limits import check_prompt_chars, check_prompt_tokens
from jaxmoe.engine.scheduler import ScheduledBatch, Scheduler
from jaxmoe.engine.sequence import Priority, Sequence
from jaxmoe.models.routing import is_exact, state_key
from jaxmoe.runtime.executor import Executor
from jaxmoe.sampling import SamplingParams, SamplingParamsError
from jaxmoe.structured_output import Grammar, GrammarBackend
from jaxmoe.tokenizer import Detokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _RequestState:
    seq: Sequence
    sampling: SamplingParams
    seed: int
    text: str = ""
    sent_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cumulative_logprob: float = 0.0
    detok: Detokenizer | None = None  # streaming detokenization (each token decoded once)
    grammar: Grammar | None = None  # structured output: what the output must match


AHEAD = -1  # async scheduling: the output token of a sequence whose step is dispatched, not read yet


@dataclasses.dataclass
class _Ahead:
    """A step dispatched and not read yet (async scheduling): its batch, sequences and launch."""

    batch: ScheduledBatch
    seqs: list[Sequence]
    launched: Launched


class LLMEngine:
    def __init__(self, cfg, executor: Executor, tokenizer, config: EngineConfig = EngineConfig(), policy=None):
        self.cfg, self.tokenizer, self.config = cfg, tokenizer, config
        self.max_model_len = min(config.max_model_len or cfg.max_position, cfg.max_position)
        max_blocks = -(-self.max_model_len // config.block_size)
        self.block_manager = _block_manager(executor, config)
        # deterministic mode without the batch-invariant CPU kernels: one fixed step shape (EngineConfig)
        fixed = config.deterministic and getattr(executor, "expert_impl", None) != "cpu_kernel_invariant"
        chunk = min(config.max_prefill_chunk, DETERMINISTIC_ROW_TOKENS) if fixed else config.max_prefill_chunk
        self.scheduler = Scheduler(
            self.block_manager,
            policy if policy is not None else make_policy(config.policy),
            max_batch_tokens=config.max_batch_tokens,
            max_num_seqs=config.max_num_seqs,
            max_waiting=config.max_waiting,
            max_prefill_chunk=chunk,
        )
        # what the KV depends on besides the tokens: the expert routing's state (e.g. the brownout threshold)
        self.scheduler.kv_key = lambda: _routing_key(self.executor)
        self.scheduler.exact_kv_key = lambda: _routing_key(self.executor, exact=True)
        plan = ShapePlan(
            max_num_seqs=config.max_num_seqs,
            max_prefill_chunk=min(chunk, config.max_batch_tokens, self.max_model_len),
            fixed=(bucket(config.max_num_seqs), DETERMINISTIC_ROW_TOKENS) if fixed else None,
        )
        self.runner = ModelRunner(executor, config.block_size, max_blocks, plan)
        self.eos_ids = set(cfg.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self._requests: dict[str, _RequestState] = {}
        self.grammars = GrammarBackend(tokenizer, cfg.vocab_size, self.eos_ids)  # structured output
        self._counter = 0
        self._seeds = _unseeded_seeds()
        self.hooks: list[StepHook] = []  # run before and after every step (``add_hook``)
        self._layer_hook: LayerHook | None = None  # ``layer_hook``
        self.step_request_ids: list[str] = []  # the requests of the last step (set before it runs)
        self._poll = None  # ``poll``
        self.emit = None  # emit(outputs): deliver outputs made inside a step at once (else step() returns them)
        self._delivered: list[RequestOutput] = []
        self._merged: list = []  # (batch, rows, seqs, MergedRows) merged into the step now running
        self.last_step_ran = False  # the latest step ran the model
        # what a front end's request leaves unset takes these (the checkpoint's generation_config)
        self.sampling_defaults: dict = {}
        self._ahead: _Ahead | None = None  # async scheduling: the step dispatched, not read yet
        self.steps_ahead = 0  # steps dispatched before the step before them was read (async scheduling)

    def add_hook(self, hook: StepHook) -> StepHook:
        """Run ``hook.before_step`` / ``after_step`` around every step from now on."""
        if not isinstance(hook, StepHook):
            raise TypeError(f"{type(hook).__name__} is not a StepHook (before_step, after_step)")
        self.hooks.append(hook)
        return hook

    @property
    def executor(self) -> Executor:
        """The executor serving now."""
        return self.runner.executor

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        priority: str | Priority = Priority.BE,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError on bad input, OverloadedError when full.
        ``cache_salt``: requests share cached prefix blocks only with requests of the same salt."""
        sampling = sampling or SamplingParams()
        sampling.validate()
        if sampling.num_sequences != 1:
            raise SamplingParamsError(
                "n",
                f"the engine runs one sequence per request, got n={sampling.n}, best_of={sampling.best_of} "
                "(LLM.generate and the servers split them: SamplingParams.for_index)",
            )
        for t in sampling.logit_bias or ():
            if t >= self.cfg.vocab_size:
                raise SamplingParamsError(
                    "logit_bias", f"token id {t} is outside the vocabulary [0, {self.cfg.vocab_size})"
                )
        if isinstance(prompt, str):  # refused by its length before the work of tokenizing it
            check_prompt_chars(len(prompt), self.max_model_len)
        else:  # nor a token list by the work of checking its ids
            check_prompt_tokens(len(prompt), self.max_model_len)
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise ValueError("empty prompt")
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < self.cfg.vocab_size)]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {self.cfg.vocab_size})")
        check_prompt_tokens(len(prompt_ids), self.max_model_len)
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        max_tokens = min(sampling.max_tokens, self.max_model_len - len(prompt_ids))
        sampling = dataclasses.replace(sampling, max_tokens=max_tokens)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        grammar = None
        if sampling.structured_outputs is not None:
            try:
                grammar = self.grammars.grammar(sampling.structured_outputs)
            except Exception as e:  # llguidance refused the grammar, or this tokenizer
                raise SamplingParamsError(sampling.structured_outputs.param, str(e).split("\n")[0]) from None
        seq = Sequence(request_id, prompt_ids, sampling, Priority.parse(priority), cache_salt=cache_salt)
        seq.use_prefix_cache = sampling.prompt_logprobs is None  # prompt logprobs need every position computed
        self.scheduler.add(seq)
        seed = sampling.seed32 if sampling.seed is not None else self._seeds.getrandbits(32)
        self._requests[request_id] = _RequestState(
            seq,
            sampling,
            seed,
            logprobs=[] if sampling.logprobs is not None else None,
            prompt_logprobs=[None] if sampling.prompt_logprobs is not None else None,
            detok=Detokenizer(self.tokenizer),
            grammar=grammar,
        )
        return request_id

    def abort(self, request_id: str) -> bool:
        state = self._requests.pop(request_id, None)
        if state is not None and state.seq.output_ids and state.seq.output_ids[-1] == AHEAD:
            state.seq.output_ids.pop()  # its token of a step still running is never emitted
        # async scheduling: a request finished by length at dispatch is held until its step is read
        return self.scheduler.abort(request_id) or state is not None

    def sequence(self, request_id: str) -> Sequence | None:
        """The sequence of a request whose final output is not made yet (None: unknown or done). With
        async scheduling that includes one the scheduler finished at dispatch, its step not read yet."""
        state = self._requests.get(request_id)
        return state.seq if state is not None else self.scheduler.get(request_id)

    @property
    def layer_hook(self) -> LayerHook | None:
        """May pause a step between its layers (QLLM's layer-level preemption); None: no step pauses."""
        return self._layer_hook

    @layer_hook.setter
    def layer_hook(self, hook: LayerHook | None) -> None:
        self._layer_hook = hook
        self.share_step_programs()

    @property
    def poll(self):
        """``poll()``: admit the requests that arrived meanwhile (``AsyncEngine``; at pause points);
        None: nothing can arrive during a step, so none pauses (``LLM.generate``)."""
        return self._poll

    @poll.setter
    def poll(self, poll) -> None:
        self._poll = poll
        self.share_step_programs()

    def share_step_programs(self) -> None:
        """Where steps may pause (a layer hook that pauses steps and a poll), an executor that can
        (``split_step``: the monolithic one) runs the steps that do not pause on the pausable steps'
        programs, so a shape compiles one set; elsewhere they run its fused step program, which costs
        nothing extra. Called again by a layer hook that changes its mind (``LayerHook.pauses_steps``)."""
        if hasattr(self.executor, "split_step"):
            self.executor.split_step = self.steps_may_pause

    @property
    def steps_may_pause(self) -> bool:
        """A layer hook that pauses steps (not one that chose step-level preemption: its
        ``pauses_steps`` False) and a serving loop's poll."""
        hook = self._layer_hook
        return hook is not None and self._poll is not None and getattr(hook, "pauses_steps", True)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._ahead is not None

    # -- one iteration ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        for hook in self.hooks:
            hook.before_step(self)
        batch = self.scheduler.schedule()
        self.last_step_ran = not batch.is_empty
        overlaps = self._overlaps(batch)
        if self._ahead is not None or overlaps:
            outputs = self._step_ahead(batch, overlaps)
        else:
            outputs = self.run_batch(batch, self._pause_points(batch)) if self.last_step_ran else []
        outputs, self._delivered = self._delivered + outputs, []
        for hook in self.hooks:
            hook.after_step(self, outputs)
        return outputs

    def _overlaps(self, batch) -> bool:
        """Whether ``batch`` may be dispatched before the step before it is read (async scheduling;
        see the module docstring for where it may not)."""
        if batch.is_empty or not self.config.async_scheduling or self.hooks or self.runner.row_tokens:
            return False  # row_tokens: deterministic mode's fixed-shape form
        if not getattr(self.executor, "overlaps_steps", False) or jax.process_count() > 1:
            return False
        for seq, _, end in batch.prefills:  # a chunk holding a token not read yet
            if end == seq.num_tokens and seq.output_ids and seq.output_ids[-1] == AHEAD:
                return False
        for seq in batch.seqs:
            state = self._requests[seq.request_id]
            s = state.sampling
            if state.grammar is not None or s.adjusts_logits or s.prompt_logprobs is not None or s.max_tokens == 0:
                return False
        return self._pause_points(batch) is None

    def _step_ahead(self, batch, overlaps: bool) -> list[RequestOutput]:
        """One step of async scheduling: dispatch ``batch`` (its decodes fed the tokens of the step
        still running), then read that step and finish its work; or, where ``batch`` cannot overlap,
        read that step first and run ``batch`` synchronously (without the sequences it stopped)."""
        ahead, self._ahead = self._ahead, None
        launched = None
        if overlaps:  # ``_overlaps(batch)``
            rows, seqs = self._rows(batch)
            self.step_request_ids = [seq.request_id for seq in seqs]
            fed = None
            if ahead is not None:
                index = {seq.request_id: i for i, seq in enumerate(ahead.seqs)}
                fed = [index.get(seq.request_id) if r.token_ids == [AHEAD] else None for seq, r in zip(seqs, rows)]
            if fed is None and any(r.token_ids == [AHEAD] for r in rows):
                raise RuntimeError("a decode row's token was not sampled by the step before")
            try:
                launched = self.runner.launch(rows, fed, ahead.launched if ahead is not None else None)
            except Exception as e:  # run it the synchronous way below, which isolates the failing requests
                log.warning("dispatching a step ahead failed (%s: %s); running it synchronously", type(e).__name__, e)
                launched = None
        outputs = self._read_ahead(ahead) if ahead is not None else []
        if launched is not None:
            self.steps_ahead += ahead is not None
            self._ahead = _Ahead(batch, seqs, launched)
            live = [(seq, r) for seq, r in zip(seqs, rows) if self.scheduler.get(seq.request_id) is seq]
            self.scheduler.postprocess(
                batch, {seq.request_id: AHEAD for seq, r in live if r.sampling is not None}
            )  # counts the token: the next step is scheduled with it
            return outputs
        batch = _without_finished(batch, self.scheduler)
        if not batch.is_empty:
            outputs += self.run_batch(batch, self._pause_points(batch))
        return outputs

    def _read_ahead(self, ahead: _Ahead) -> list[RequestOutput]:
        """Read a dispatched step's tokens (waiting for it) and do what ``_finish`` does for a step:
        stop conditions, logprobs, finishing requests, outputs. Its sequences already hold a
        placeholder token (``AHEAD``), replaced here; one the scheduler finished by length keeps its
        finish unless the token stops it."""
        try:
            sampled = self.runner.collect(ahead.launched)
        except Exception as e:  # the step failed on the device: its requests fail
            message = f"engine step failed: {type(e).__name__}: {e}"
            outputs = []
            for seq in ahead.seqs:
                if seq.request_id in self._requests:
                    if seq.output_ids and seq.output_ids[-1] == AHEAD:
                        seq.output_ids.pop()
                    outputs.append(self._failed(seq, message))
            self._recover_cache()
            return outputs
        now = time.monotonic()
        finished, touched, failed = {}, [], []
        for seq, s in zip(ahead.seqs, sampled):
            state = self._requests.get(seq.request_id)
            if s is None or state is None or not seq.output_ids or seq.output_ids[-1] != AHEAD:
                continue  # a partial prefill chunk, or aborted meanwhile
            seq.output_ids[-1] = s.token_id
            seq.last_token_time = now
            if seq.num_output_tokens == 1:
                seq.first_token_time = now
            try:
                reason = self._stop_reason(state, s.token_id)
            except Exception as e:
                failed.append(self._failed(seq, f"{type(e).__name__}: {e}"))
                continue
            self._record(state, s)
            touched.append(seq)
            if reason:
                finished[seq.request_id] = reason
                if seq.is_finished:  # by length, at dispatch: the stop decides, as in ``postprocess``
                    seq.finish_reason = reason
        self.scheduler.postprocess(ScheduledBatch(), {}, finished)  # frees their blocks
        outputs = []
        for seq in touched:
            try:
                outputs.append(self._output(self._requests[seq.request_id]))
            except Exception as e:
                failed.append(self._failed(seq, f"{type(e).__name__}: {e}"))
        return outputs + failed

    def _record(self, state: _RequestState, s) -> None:
        """A sampled token's logprobs, into its request's state."""
        state.cumulative_logprob += s.logprob
        if state.logprobs is not None:
            decode = self.tokenizer.decode
            state.logprobs.append(
                TokenLogprob(
                    s.token_id, s.logprob, s.top, s.rank, decode([s.token_id]), [decode([t]) for t, _ in s.top]
                )
            )

    def _pause_points(self, batch):
        """``between_layers`` for a batch the layer hook may pause (None: one fused program)."""
        hook = self.layer_hook
        if hook is None or not hook.pausable(self, batch):
            return None
        return lambda layer: hook.between_layers(self, layer)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Outputs made inside a step (a batch run while another is paused): to their streams now
        (``emit``), else returned with the step's own."""
        if self.emit is not None:
            self.emit(outputs)
        else:
            self._delivered += outputs

    def swap_executor(self, runner: ModelRunner, move_kv) -> list[str]:
        """Serve from ``runner.executor`` from the next step on (between steps only): every live
        sequence's KV blocks get blocks in the new KV layout (a partition of their own), copied
        there by ``move_kv(old executor, new executor, moves)``; a sequence that does not fit is
        recompute-preempted (its tokens kept). Returns the ids of those."""
        block_manager = BlockManager.for_layout(
            runner.executor.kv_layout, self.block_manager.prefix_caching
        )  # an empty cache index
        moves, recomputed = self.scheduler.move_kv_to(block_manager)
        move_kv(self.runner.executor, runner.executor, moves)
        self.block_manager, self.runner = block_manager, runner
        return recomputed

    def run_batch(self, batch, between_layers=None) -> list[RequestOutput]:
        """Run one scheduled batch through the model, sample and record its tokens; the outputs of
        its requests (failed ones with ``error`` set); those of the batches merged into it at its pause
        points (``merge_batch``) go out as their program call ends (``deliver``), or with these where
        that call failed. ``between_layers``: called at the step's pause points (a layer hook
        may run another batch there, or merge one into this)."""
        rows, seqs = self._rows(batch)
        self.step_request_ids = [seq.request_id for seq in seqs]
        outer, self._merged = self._merged, []
        errors: dict[str, str] = {}
        try:
            sampled = self._run_isolating(rows, seqs, errors, between_layers)
        finally:
            self.step_request_ids = [seq.request_id for seq in seqs]
            merged, self._merged = self._merged, outer
        outputs = []
        for inner, inner_rows, inner_seqs, group in merged:  # those whose call did not finish
            if group.sampled is None:  # the merged call failed: the inner batch runs again on its own
                outputs += self.run_batch(inner)
            else:
                outputs += self._finish(inner, inner_rows, inner_seqs, group.sampled, {})
        return outputs + self._finish(batch, rows, seqs, sampled, errors)

    def merge_batch(self, batch, accept=None) -> Merge:
        """QLLM's merge: join a scheduled batch to the step now paused (called at its pause point);
        its rows catch up to that point alone, then share the rest of the step with the step's rows,
        and its outputs go out (``deliver``) as soon as the program call it joined ends
        (``Merge.MERGED``). Else why not (the runner's ``offer_merge``): ``Merge.DECLINED`` where
        ``accept`` (the caller's say on the merged call's shape) said no, ``Merge.UNAVAILABLE`` where
        it cannot join here; the caller runs it another way."""
        if batch.is_empty:
            return Merge.UNAVAILABLE
        rows, seqs = self._rows(batch)
        group = MergedRows(rows)
        outcome = self.runner.offer_merge(group, accept)
        if outcome is not Merge.MERGED:
            return outcome
        entry = (batch, rows, seqs, group)
        self._merged.append(entry)
        group.on_sampled = lambda: self._merged_sampled(entry)
        self.step_request_ids = self.step_request_ids + [seq.request_id for seq in seqs]
        return outcome

    def _merged_sampled(self, entry) -> None:
        """A merged batch's program call has run: its tokens go out now (``deliver``), not after the
        rest of the step it joined (the step's later program calls)."""
        if any(e is entry for e in self._merged):
            self._merged = [e for e in self._merged if e is not entry]
            inner, rows, seqs, group = entry
            self.deliver(self._finish(inner, rows, seqs, group.sampled, {}))

    def _rows(self, batch) -> tuple[list[Row], list[Sequence]]:
        rows, seqs = [], []
        for seq, start, end in batch.prefills:
            rows.append(self._row(seq, seq.all_ids[start:end], start, sample=end == seq.num_tokens))
            seqs.append(seq)
        for seq in batch.decodes:
            rows.append(self._row(seq, [seq.last_token_id], seq.num_tokens - 1, sample=True))
            seqs.append(seq)
        return rows, seqs

    def _finish(self, batch, rows: list[Row], seqs: list[Sequence], sampled, errors: dict[str, str]):
        """Record a batch's sampled tokens (stop conditions, logprobs, the scheduler's postprocess);
        its outputs."""
        self._score_prompts(batch, rows, errors)
        new_tokens, finished = {}, {}
        for seq, s in zip(seqs, sampled):
            if s is None or seq.request_id in errors:
                continue
            state = self._requests[seq.request_id]
            if state.sampling.max_tokens == 0:  # prompt scoring only: the sampled token is not kept
                finished[seq.request_id] = "length"
                continue
            try:
                if state.grammar is not None:
                    state.grammar.accept(s.token_id)
                reason = self._stop_reason(state, s.token_id)
                if reason is None and state.grammar is not None and state.grammar.done:
                    reason = "stop"  # the output is complete: nothing more fits the grammar
            except Exception as e:  # this request's own settings broke its post-processing
                errors[seq.request_id] = f"{type(e).__name__}: {e}"
                continue
            new_tokens[seq.request_id] = s.token_id
            self._record(state, s)
            if reason:
                finished[seq.request_id] = reason
        failed = [self._failed(seq, errors[seq.request_id]) for seq in seqs if seq.request_id in errors]
        self.scheduler.postprocess(batch, new_tokens, finished)  # skips the failed (aborted) ones
        outputs = []
        for seq in seqs:
            if seq.request_id in errors or not (seq.request_id in new_tokens or seq.is_finished):
                continue
            try:
                outputs.append(self._output(self._requests[seq.request_id]))
            except Exception as e:  # e.g. detokenizing this request's tokens
                failed.append(self._failed(seq, f"{type(e).__name__}: {e}"))
        return outputs + failed

    def _score_prompts(self, batch, rows: list[Row], errors: dict[str, str]) -> None:
        """Prompt logprobs of the prefill chunks whose requests ask for them (scoring, e.g.
        lm-evaluation-harness loglikelihood): the logprob of each prompt token given the ones before."""
        for (seq, start, end), row in zip(batch.prefills, rows):
            state = self._requests.get(seq.request_id)
            if state is None or state.prompt_logprobs is None or seq.request_id in errors:
                continue
            targets = seq.prompt_ids[start + 1 : min(end + 1, len(seq.prompt_ids))]
            if not targets:
                continue
            try:
                scored = self.runner.score(row, targets, state.sampling.prompt_logprobs)
            except Exception as e:
                errors[seq.request_id] = f"scoring the prompt failed: {type(e).__name__}: {e}"
                continue
            decode = self.tokenizer.decode
            state.prompt_logprobs += [
                TokenLogprob(t, lp, top, None, decode([t]), [decode([a]) for a, _ in top])
                for t, (lp, top) in zip(targets, scored)
            ]

    def _run_isolating(
        self, rows: list[Row], seqs: list[Sequence], errors: dict[str, str], between_layers=None
    ) -> list:
        """``runner.run(rows)``; when it raises, only the requests that make it fail are failed
        (``errors``): the rows are run again in halves until the failing ones are found. Rows
        run twice write the same KV again. If the failed program took the KV cache with it, the
        cache is re-allocated and the whole step fails (``StepFailedError``: every sequence then
        recomputes its KV)."""
        try:
            return self.runner.run(rows, between_layers)
        except Exception as e:
            if self._recover_cache():
                raise StepFailedError([seq.request_id for seq in seqs], e) from e
            if len(rows) == 1:
                errors[seqs[0].request_id] = f"engine step failed: {type(e).__name__}: {e}"
                return [None]
            mid = len(rows) // 2
            return self._run_isolating(rows[:mid], seqs[:mid], errors) + self._run_isolating(
                rows[mid:], seqs[mid:], errors
            )

    def _failed(self, seq: Sequence, message: str) -> RequestOutput:
        """Abort a request that failed in this step; its final output carries the error."""
        state = self._requests.get(seq.request_id)
        self.abort(seq.request_id)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_ids,
            token_ids=list(seq.output_ids),
            text=state.text if state else "",
            delta_token_ids=[],
            delta_text="",
            logprobs=list(state.logprobs) if state and state.logprobs is not None else None,
            finished=True,
            finish_reason="error",
            priority=seq.priority.value,
            ttft=seq.ttft,
            tpot=seq.tpot,
            error=message,
        )

    def _recover_cache(self) -> bool:
        """After a failed run: if the executor's KV cache is gone (a failed program that donates
        the cache deletes it), allocate a new one (every sequence that had KV recomputes it) and
        return True."""
        executor = self.executor
        if any(a.is_deleted() for a in jax.tree.leaves(executor.cache)):
            executor.reset_cache()
            self.scheduler.drop_all_kv()
            return True
        return False

    def _row(self, seq: Sequence, tokens: list[int], start: int, sample: bool) -> Row:
        state = self._requests[seq.request_id]
        penalized = sample and state.sampling.adjusts_logits
        return Row(
            tokens,
            start,
            list(seq.block_table),
            state.sampling if sample else None,
            state.seed,
            seq.num_output_tokens,
            history=seq.prompt_ids + seq.output_ids if penalized else None,
            num_prompt=len(seq.prompt_ids),
            allowed=state.grammar.mask() if sample and state.grammar is not None else None,
        )

    def _stop_reason(self, state: _RequestState, token: int) -> str | None:
        """Detokenize the new token (incrementally) and say whether it ends the request: a stop
        token, EOS, or a stop string that ends in the new text."""
        s = state.sampling
        before = len(state.detok.text)
        piece = state.detok.add(token)
        if token in s.stop_token_ids or (token in self.eos_ids and not s.ignore_eos):
            return "stop"
        if s.stop and piece:
            text = state.detok.text
            for stop in s.stop:
                if stop and stop in text[max(0, before - len(stop) + 1) :]:
                    return "stop"
        return None

    def _output(self, state: _RequestState) -> RequestOutput:
        seq = state.seq
        ids = seq.output_ids
        if seq.is_finished:
            self._requests.pop(seq.request_id, None)
            text = _cut_at_stop(state.detok.finish(ids), state.sampling.stop)
        else:  # a character split over tokens appears once complete
            text = state.detok.text
            hold = max((len(x) for x in state.sampling.stop), default=1) - 1
            if hold:  # text that may be the start of a stop string waits (vLLM's stop buffer)
                text = text[: max(len(state.text), len(text) - hold)]
        delta_text, state.text = text[len(state.text) :], text
        first = state.sent_tokens == 0 and len(ids) > 0  # the prompt is fully scored by now
        delta_ids, state.sent_tokens = ids[state.sent_tokens :], len(ids)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_ids,
            token_ids=list(ids),
            text=text,
            delta_token_ids=list(delta_ids),
            delta_text=delta_text,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            priority=seq.priority.value,
            ttft=seq.ttft,
            tpot=seq.tpot,
            cumulative_logprob=state.cumulative_logprob,
            num_cached_tokens=seq.num_cached_tokens or 0,
            prompt_logprobs=list(state.prompt_logprobs)
            if state.prompt_logprobs is not None and (seq.is_finished or first)
            else None,
        )

    # -- convenience -------------------------------------------------------------------------
    def run_until_done(self, timeout: float | None = None) -> dict[str, RequestOutput]:
        final: dict[str, RequestOutput] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.has_work():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("engine did not finish in time")
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return final


def _without_finished(batch, scheduler: Scheduler):
    """``batch`` without the sequences the scheduler no longer holds (stopped or aborted since)."""
    live = lambda seq: scheduler.get(seq.request_id) is seq  # noqa: E731
    return ScheduledBatch(
        [(seq, a, b) for seq, a, b in batch.prefills if live(seq)],
        [seq for seq in batch.decodes if live(seq)],
        batch.preempted,
    )


def _block_manager(executor, config: EngineConfig) -> BlockManager:
    """Blocks of the executor's KV layout (``executor.kv_layout``: whole blocks per attention instance,
    one partition per instance, so a sequence's KV never leaves its instance)."""
    layout = executor.kv_layout
    if layout.block_size != config.block_size:
        raise ValueError(
            f"block_size: the engine's is {config.block_size}, the executor's KV cache uses {layout.block_size}"
        )
    return BlockManager.for_layout(layout, config.prefix_caching)


def _routing_key(executor, exact: bool = False) -> str:
    """The prefix-cache key of the executor's expert routing: its name, state (brownout's thresholds:
    KV computed under one threshold is not read under another) and parameter version (extra experts
    loaded at run time, ``params_version``). A state that routes as the checkpoint's top-k
    (``models.routing.is_exact``: brownout at threshold 1) has the exact key, which is also
    ``exact=True``'s: the key of the KV every state may read (a browned-out step reads the exact
    model's KV; the exact model never reads browned-out KV)."""
    routing = getattr(executor, "routing", None)
    version = getattr(executor, "params_version", 0)
    state = getattr(executor, "routing_state", None)
    if exact or is_exact(routing, state):
        return f"exact:{version}"
    return f"{getattr(routing, 'name', None)}:{state_key(state)!r}:{version}"


def _cut_at_stop(text: str, stops) -> str:
    cut = min((text.find(s) for s in stops if s and s in text), default=-1)
    return text if cut < 0 else text[:cut]


def _unseeded_seeds():
    """Where unseeded requests get their seed (``.getrandbits``). One process: Python's
    ``random``. Under ``jax.distributed`` every process must draw the same seeds, or sampling
    diverges and the next collective hangs: a generator seeded once from process 0 (a broadcast,
    so every process must build the engine); processes add the same requests in the same order."""
    if jax.process_count() == 1:
        return random
    from jax.experimental import multihost_utils

    return random.Random(int(multihost_utils.broadcast_one_to_all(np.uint32(random.getrandbits(32)))))
