"""Turns one scheduled step (rows of tokens with their positions and block tables) into padded
device arrays, runs the executor (monolithic or disaggregated) and samples the next tokens.

Shapes are bucketed to powers of two (rows, tokens per row — at least 16 for a prefill chunk) so a
serving run compiles a handful of programs, not one per batch; block tables always have the same
width (``max_blocks_per_seq``: attention loops over the blocks a step needs, so no program depends
on context length); a step mixing decodes and prefill chunks runs them as two batches (``run``).

Row placement: an executor with m attention instances (``num_attention``) splits the batch rows
contiguously over them and holds the KV cache slot range j*S/m .. (j+1)*S/m on instance j. The
runner puts each row in the row range of the instance that holds its first KV block (with the
engine's partitioned ``BlockManager``, all its blocks): B = m * R rows, R the bucketed largest
per-instance row count, padding rows with slot -1, block table padding with the instance's first
block, so the executor can run attention per instance (``DisaggregatedExecutor.is_local``).
Results come back in the callers' row order.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.engine.buckets import MIN_PREFILL_TOKENS, ShapePlan, bucket
from jaxmoe.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    SamplingParams,
    adjust_logits,
    mask_logits,
    sample,
    sample_invariant,
)
from jaxmoe.models.attention import AttentionBatch
from jaxmoe.runtime.executor import LowersAhead, MergesRows, RowMerge


@dataclasses.dataclass
class Row:
    """One sequence's work in a step: ``token_ids`` at positions ``start``.. of the sequence."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    sampling: SamplingParams | None = None  # None: no token is sampled (a non-final prefill chunk)
    seed: int = 0
    step: int = 0  # tokens generated so far (varies the random key)
    history: list[int] | None = None  # prompt + output ids, for penalties (``SamplingParams.adjusts_logits``)
    num_prompt: int = 0  # how many of ``history`` are the prompt
    allowed: np.ndarray | None = None  # structured output: the tokens allowed next (packed bits, ``mask_logits``)


class Merge(enum.Enum):
    """What became of rows offered to the program call paused at a pause point (``offer_merge``)."""

    MERGED = "merged"  # they joined it
    DECLINED = "declined"  # the caller's ``accept`` said no (QLLM's cost model): they may run alone
    UNAVAILABLE = "unavailable"  # they cannot join here (the executor, the instances, the shape)


@dataclasses.dataclass
class MergedRows:
    """Rows merged into a running program call at a pause point (QLLM's merge): ``sampled`` is
    set, in ``rows``' order, once the call has run (None: it failed before)."""

    rows: list[Row]
    sampled: list | None = None
    # called as soon as ``sampled`` is set: at the end of the program call they joined, not of the
    # step (a step may run more calls after it: its prefill chunks after its decodes)
    on_sampled: Callable[[], None] | None = None


@dataclasses.dataclass
class _Call:
    """The program call now running layer by layer: its rows (merged ones appended), the merges."""

    rows: list[Row]
    groups: list[MergedRows] = dataclasses.field(default_factory=list)
    pending: RowMerge | None = None  # handed to the executor when the pause point returns


@dataclasses.dataclass
class Sampled:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top alternatives (token id, logprob), when asked
    rank: int | None = None  # of the token in the model's distribution (1 = most likely), when asked


class ModelRunner:
    def __init__(self, executor, block_size: int, max_blocks_per_seq: int, plan: ShapePlan | None = None):
        self.executor = executor
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.plan = plan or ShapePlan(max_num_seqs=64, max_prefill_chunk=512)
        self.kv = executor.kv_layout  # slots, and which attention instance holds a block
        self.pausable_state_bytes = 0  # of the step now running layer by layer (layer-level preemption)
        self.last_calls: list[tuple[int, int]] = []  # (rows, tokens per row) of each program call of the last run
        self._call: _Call | None = None  # the call running layer by layer (rows may merge into it)
        self.num_instances = self.kv.num_instances
        # deterministic mode in its fixed-shape form (EngineConfig.deterministic): every step is one call of
        # ``fixed_rows`` rows per attention instance of ``row_tokens`` tokens (decodes padded too), so every
        # program runs on one shape whatever the batch: XLA:CPU picks a dot's algorithm (its summation order)
        # by shape
        self.fixed_rows, self.row_tokens = self.plan.fixed or (1, 0)

    def instance_of(self, row: Row) -> int:
        return int(self.kv.instance_of_block(row.block_table[0]))

    def placement(self, rows: list[Row], min_rows: int = 1) -> tuple[np.ndarray, int]:
        """(padded row of each row [len(rows)], padded rows B): rows of instance j at j*R.., B = m*R,
        R at least ``min_rows``."""
        m = self.num_instances
        inst = [self.instance_of(r) for r in rows]
        R = bucket(max(int(np.bincount(inst, minlength=m).max()), min_rows))
        where, used = [], [0] * m
        for j in inst:
            where.append(j * R + used[j])
            used[j] += 1
        return np.array(where), m * R

    def _empty(self, B: int, T: int):
        """Padding-only arrays for B rows of T tokens: slot -1 (no KV write), tables of the instance's
        first block."""
        first = self.kv.first_block(np.arange(B, dtype=np.int32) // (B // self.num_instances))
        tables = np.repeat(first[:, None], self.max_blocks_per_seq, axis=1)
        zeros = np.zeros((B, T), np.int32)
        return zeros, AttentionBatch(zeros.copy(), np.full((B, T), -1, np.int32), tables), np.zeros((B,), np.int32)

    def prepare(self, rows: list[Row]):
        """Padded (tokens [B, T], AttentionBatch, logits_index [B]) for the rows, and each row's
        padded row ``where`` [len(rows)] (see ``placement``)."""
        T = self._row_tokens(rows)
        if T is None:
            longest = max(len(r.token_ids) for r in rows)
            raise ValueError(f"deterministic mode: a row of {longest} tokens exceeds {self.row_tokens}")
        where, B = self.placement(rows, self.fixed_rows)
        tokens, batch, last = self._empty(B, T)
        positions, slots, tables = batch
        for i, r in zip(where, rows):
            n = len(r.token_ids)
            pos = np.arange(r.start, r.start + n)
            table = np.asarray(r.block_table, np.int32)
            tokens[i, :n] = r.token_ids
            positions[i, :n] = pos
            slots[i, :n] = self.kv.slots(table, pos)
            tables[i, : len(table)] = table
            last[i] = n - 1
        return tokens, batch, last, where

    def _row_tokens(self, rows: list[Row]) -> int | None:
        """Tokens per padded row of a call of ``rows`` (``prepare``'s T); None: a row is longer than
        deterministic mode's fixed row."""
        longest = max(len(r.token_ids) for r in rows)
        if self.row_tokens:
            return self.row_tokens if longest <= self.row_tokens else None
        return 1 if longest == 1 else bucket(longest, MIN_PREFILL_TOKENS)

    def warm(self, rows_per_instance: int, tokens: int, layer_by_layer: bool = False) -> None:
        """Compile (by running) the step program for one bucket shape, on padding rows: no KV is
        written, so it is safe while sequences hold KV (``layer_by_layer``: the per-layer programs
        that layer-level preemption runs)."""
        self.run_padding(rows_per_instance, tokens, (lambda layer: None) if layer_by_layer else None)

    def run_padding(self, rows_per_instance: int, tokens: int, between_layers=None) -> None:
        """One step of a bucket shape on padding rows (no KV written), the forward pass and the sampler,
        its tokens read back (``between_layers``: layer by layer, called at its pause points)."""
        B = self.num_instances * rows_per_instance
        args = self._empty(B, tokens)
        self._execute(
            *args,
            _sampling_arrays(B),
            want_logprobs=False,
            between_layers=between_layers,
            allowed=self._allowed_array(B, self.executor.cfg.vocab_size),
        )

    def lower(
        self, rows_per_instance: int, tokens: int, sampler: bool = True, layer_by_layer: bool = False
    ) -> list[jax.stages.Lowered] | None:
        """The programs a step of one bucket shape runs (the executor's fused step, and the sampler
        for its batch size unless ``sampler`` is False; ``layer_by_layer``: also the per-layer
        programs of a pausable step), traced and lowered on the same argument types as ``run``'s,
        not compiled: compiling them (any thread) is what ``warm`` does by running. None: the
        executor cannot lower ahead (``runtime.executor.LowersAhead``)."""
        if not isinstance(self.executor, LowersAhead):
            return None
        B = self.num_instances * rows_per_instance
        args = self._empty(B, tokens)
        programs, logits = self.executor.lower(*args)
        if layer_by_layer:
            programs = programs + self.executor.lower_layers(*args)
        return programs + (self._lower_sampler(B, logits, keep_sharding=False) if sampler else [])

    def lower_step(self, rows_per_instance: int, tokens: int) -> list[jax.stages.Lowered] | None:
        """What ``warm`` compiles by running, lowered instead (the executor's ``lower_step``: the
        disaggregated one, also across processes, where running would launch collectives), and the
        sampler: nothing runs, so a thread may compile them while another executor serves. None: the
        executor cannot (no ``lower_step``, or not for this shape)."""
        lower = getattr(self.executor, "lower_step", None)
        B = self.num_instances * rows_per_instance
        lowered = None if lower is None else lower(*self._empty(B, tokens))
        if lowered is None:
            return None
        programs, logits = lowered
        return programs + self._lower_sampler(B, logits)

    def _lower_sampler(self, B: int, logits, keep_sharding: bool = True) -> list[jax.stages.Lowered]:
        """The sampler programs of a step of B rows on logits shaped like ``logits``, lowered
        (``keep_sharding``: the float32 logits after ``adjust_logits`` on the devices of ``logits``)."""
        programs = [sample.lower(logits, logits, *_sampling_arrays(B), np.bool_(False))]
        programs.append(adjust_logits.lower(logits, *self._adjusted_arrays(B)))
        allowed = self._allowed_array(B, logits.shape[-1])
        programs.append(mask_logits.lower(logits, allowed))
        if logits.dtype != jnp.float32:  # after ``adjust_logits`` (float32)
            sharding = getattr(logits, "sharding", None) if keep_sharding else None
            f32 = jax.ShapeDtypeStruct(logits.shape, jnp.float32, sharding=sharding)
            programs.append(mask_logits.lower(f32, allowed))
        return programs

    def score(self, row: Row, targets: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
        """Logprob of each of ``targets`` (the tokens after each of the row's positions) and the top
        alternatives, from the logits at every position of the row (another forward over the same
        chunk: it writes the same KV again)."""
        logits = self.forward([row], all_logits=True)  # [1, T, V], T the chunk's token bucket
        padded = np.zeros(logits.shape[1], np.int32)  # one program per token bucket, whatever the length
        padded[: len(targets)] = targets
        lp, ids, tops = jax.device_get(_score(logits, padded))
        return [
            (float(lp[i]), [(int(t), float(v)) for t, v in zip(ids[i, :top], tops[i, :top])])
            for i in range(len(targets))
        ]

    def warm_scoring(self, tokens: int) -> None:
        """Compile (by running, on padding that writes no KV) what ``score`` runs for a prefill chunk
        of ``tokens`` tokens: the all-positions forward, the row gather and ``_score``."""
        B = self.num_instances * bucket(1)
        padding, batch, _ = self._empty(B, tokens)
        logits = self.executor.forward(padding, batch, None)[np.zeros(1, dtype=np.int64)]
        jax.block_until_ready(_score(logits, np.zeros(tokens, np.int32)))

    def warm_feed(self) -> int:
        """Compile (by running on zeros) what async scheduling adds to a step: ``_feed`` for each pair
        of a call whose rows may be fed (a decode call; in the fixed-shape form the one call) and the
        rows of a call before it. Returns the pairs."""
        m = self.num_instances
        calls = {(m * r, t) for r, t in self.plan.shapes()}
        fed = [(B, T) for B, T in sorted(calls) if T == 1 or self.row_tokens]
        sources = sorted({B for B, _ in calls})
        for B, T in fed:
            for source in sources:
                jax.block_until_ready(
                    _feed(np.zeros((B, T), np.int32), jnp.zeros(source, jnp.int32), np.full(B, -1, np.int32))
                )
        return len(fed) * len(sources)

    def forward(self, rows: list[Row], all_logits: bool = False):
        """Logits of the rows, in their order: [len(rows), V] at each row's last token, or
        [len(rows), T, V] with ``all_logits``."""
        tokens, batch, last, where = self.prepare(rows)
        return self.executor.forward(tokens, batch, None if all_logits else last)[where]

    def run(self, rows: list[Row], between_layers=None) -> list[Sampled | None]:
        """One step: forward every row, sample a token for rows that have sampling params.

        Decodes (one token per row) and prefill chunks run as separate program calls: one padded
        [B, T] batch would pad every decode row to the longest chunk (16 decodes beside a 256-token
        chunk: 4096 token slots for 272 tokens). Prefill chunks go at most ``plan.prefill_rows`` per
        attention instance to a call, so every call has a shape of ``plan.shapes()``.
        """
        out: list[Sampled | None] = [None] * len(rows)
        self.last_calls = []
        for group in self._calls(rows):
            for i, sampled in zip(group, self._run([rows[i] for i in group], between_layers)):
                out[i] = sampled
        return out

    def _calls(self, rows: list[Row]) -> list[list[int]]:
        if self.row_tokens:  # deterministic mode: the whole step in one call of the one shape
            return [list(range(len(rows)))]
        decodes = [i for i, r in enumerate(rows) if len(r.token_ids) == 1]
        calls = [decodes] if decodes else []
        per_instance: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            if len(r.token_ids) > 1:
                per_instance.setdefault(self.instance_of(r), []).append(i)
        k = self.plan.prefill_rows
        while any(per_instance.values()):
            calls.append([i for idx in per_instance.values() for i in idx[:k]])
            per_instance = {j: idx[k:] for j, idx in per_instance.items()}
        return calls

    def offer_merge(self, group: MergedRows, accept: Callable[[tuple, tuple], bool] | None = None) -> Merge:
        """QLLM's merge: ``group.rows`` join the program call now paused (called from its pause point:
        a layer boundary, or inside a MoE layer with per-expert queues); they catch up to that point
        alone, then share the rest of the step with the call's rows, and their results go to
        ``group`` (``Merge.MERGED``). ``accept(merged shape, the rows' own shape)`` (padded [rows,
        tokens] of the merged call and of the rows alone) has the first say (``Merge.DECLINED``: the
        caller may run them alone); else ``Merge.UNAVAILABLE`` where the executor cannot merge there
        (``MergesRows``), with several attention instances, or where the merged shape is not one
        warm-up compiles (``plan.shapes()``). The padded arrays are built only for a merge that is
        taken."""
        call, ex, rows = self._call, self.executor, group.rows
        if call is None or call.pending is not None or not rows or self.num_instances != 1:
            return Merge.UNAVAILABLE
        if not (isinstance(ex, MergesRows) and ex.merge_ready()):
            return Merge.UNAVAILABLE
        merged = call.rows + rows
        merged_tokens = self._row_tokens(merged)
        if merged_tokens is None:
            return Merge.UNAVAILABLE
        merged_shape = (self.placement(merged, self.fixed_rows)[1], merged_tokens)
        own_shape = (self.placement(rows, self.fixed_rows)[1], self._row_tokens(rows))
        # the caller's say first: a merge it declines is declined whether or not its shape is compiled
        if accept is not None and not accept(merged_shape, own_shape):
            return Merge.DECLINED
        if merged_shape not in self.plan.shapes():
            return Merge.UNAVAILABLE
        _, merged_batch, merged_last, _ = self.prepare(merged)
        tokens, batch, _, _ = self.prepare(rows)
        call.pending = RowMerge(tokens, batch, len(rows), len(call.rows), merged_batch, merged_last)
        call.rows = merged
        call.groups.append(group)
        return Merge.MERGED

    def _run(self, rows: list[Row], between_layers=None) -> list[Sampled | None]:
        """Forward + sample one padded batch; only the sampled tokens (and logprobs) come back. Rows
        merged in at its pause points (``offer_merge``) are sampled with it: their results go to their
        ``MergedRows``."""
        tokens_in, batch, last, where = self.prepare(rows)
        self.last_calls.append(tuple(tokens_in.shape))
        call, outer = _Call(list(rows)), self._call
        if between_layers is not None:
            between_layers = self._merge_points(between_layers, call)
        self._call = call if between_layers is not None else None
        try:
            logits = self._forward(tokens_in, batch, last, between_layers)
        finally:
            self._call = outer
        if call.groups:  # the merged rows (the running ones first, in order, then the new ones)
            rows = call.rows
            where = self.placement(rows, self.fixed_rows)[0]
        out = _unpack(rows, where, self._sample_rows(logits, rows, where))
        first = len(out) - sum(len(g.rows) for g in call.groups)
        for group in call.groups:
            group.sampled, first = out[first : first + len(group.rows)], first + len(group.rows)
        for group in call.groups:
            if group.on_sampled is not None:
                group.on_sampled()
        return out[: len(out) - sum(len(g.rows) for g in call.groups)]

    def launch(self, rows: list[Row], fed: list[int | None] | None = None, feed: Launched | None = None) -> Launched:
        """``run`` without reading the results (async scheduling): every program call of the step is
        dispatched and the sampler's outputs stay on the device until ``collect``. ``fed[i]``: the row
        of ``feed`` (the step before, dispatched and maybe still running) whose sampled token is row
        i's input token -- a decode row's one token, taken on the device; None: row i's own tokens.
        No pause points, no merges."""
        self.last_calls = []
        calls = []
        for group in self._calls(rows):
            sub = [rows[i] for i in group]
            tokens, batch, last, where = self.prepare(sub)
            self.last_calls.append(tuple(tokens.shape))
            if fed is not None and feed is not None:
                tokens = _fed_tokens(tokens, [fed[i] for i in group], where, feed)
            logits = self._forward(tokens, batch, last)
            calls.append((group, where, self._sample_rows(logits, sub, where, fetch=False)))
        return Launched(rows, calls)

    def collect(self, launched: Launched) -> list[Sampled | None]:
        """The sampled tokens of a launched step, in its rows' order (blocks until it has run)."""
        results = jax.device_get([result for _, _, result in launched.calls])
        out: list[Sampled | None] = [None] * len(launched.rows)
        for (group, where, _), result in zip(launched.calls, results):
            for i, sampled in zip(group, _unpack([launched.rows[i] for i in group], where, result)):
                out[i] = sampled
        return out

    def _sample_rows(self, logits, rows: list[Row], where, fetch: bool = True):
        """The sampler over a call's logits for its rows (padded rows ``where``): (tokens, logprob,
        rank, top ids, top logprobs), on the host (``fetch``) or on the device."""
        B = logits.shape[0]
        adjusted = any(r.sampling is not None and r.sampling.adjusts_logits for r in rows)
        sampling = _sampling_arrays(B, rows, where)
        extras = self._adjusted_arrays(B, rows, where) if adjusted else None
        masked = any(r.sampling is not None and r.allowed is not None for r in rows)
        allowed = self._allowed_array(B, self.executor.cfg.vocab_size, rows, where) if masked else None
        want_logprobs = any(r.sampling is not None and r.sampling.logprobs is not None for r in rows)
        return self._sample(logits, sampling, want_logprobs, extras, allowed, fetch=fetch)

    def _merge_points(self, between_layers, call: _Call):
        """``between_layers`` that hands the executor the rows merged at the pause point (or None)."""

        def point(layer):
            between_layers(layer)
            pending, call.pending = call.pending, None
            return pending

        return point

    def _adjusted_arrays(self, B: int, rows: list[Row] = (), where=()) -> tuple[np.ndarray, ...]:
        """What ``adjust_logits`` takes beyond the logits: presence, frequency, repetition [B], history [B, W], num_prompt [B], bias ids / values
        [B, MAX_LOGIT_BIAS]; W = the longest sequence the block tables hold (one shape per batch size)."""
        W = self.max_blocks_per_seq * self.block_size
        presence, frequency = np.zeros(B, np.float32), np.zeros(B, np.float32)
        repetition = np.ones(B, np.float32)
        history = np.full((B, W), -1, np.int32)
        num_prompt = np.zeros(B, np.int32)
        bias_ids = np.full((B, MAX_LOGIT_BIAS), -1, np.int32)
        bias_values = np.zeros((B, MAX_LOGIT_BIAS), np.float32)
        for i, r in zip(where, rows):
            s = r.sampling
            if s is None or not s.adjusts_logits:
                continue
            presence[i], frequency[i], repetition[i] = s.presence_penalty, s.frequency_penalty, s.repetition_penalty
            if r.history is not None:
                h = r.history[-W:]
                history[i, : len(h)] = h
                num_prompt[i] = max(0, r.num_prompt - (len(r.history) - len(h)))
            if s.logit_bias:
                bias_ids[i, : len(s.logit_bias)] = list(s.logit_bias)
                bias_values[i, : len(s.logit_bias)] = list(s.logit_bias.values())
        return presence, frequency, repetition, history, num_prompt, bias_ids, bias_values

    def _allowed_array(self, B: int, vocab: int, rows: list[Row] = (), where=()) -> np.ndarray:
        """What ``mask_logits`` takes: [B, ceil(vocab / 32)] packed bits, every bit set but in rows
        with a grammar (``Row.allowed``)."""
        allowed = np.full((B, -(-vocab // 32)), -1, np.int32)
        for i, r in zip(where, rows):
            if r.sampling is not None and r.allowed is not None:
                allowed[i] = r.allowed[: allowed.shape[1]]
        return allowed

    def _execute(
        self, tokens, batch, last, sampling, want_logprobs: bool, between_layers=None, extras=None, allowed=None
    ):
        """The executor's forward pass, then the sampler (``_sample``)."""
        logits = self._forward(tokens, batch, last, between_layers)
        return self._sample(logits, sampling, want_logprobs, extras, allowed)

    def _forward(self, tokens, batch, last, between_layers=None):
        """The executor's forward pass (``between_layers``: the executor runs layer by layer and calls
        it between layers)."""
        if between_layers is None:
            return self.executor.forward(tokens, batch, last)
        self.pausable_state_bytes = self._pause_state_bytes(int(np.prod(np.shape(tokens))))
        return self.executor.forward(tokens, batch, last, between_layers=between_layers)

    def _sample(self, logits, sampling, want_logprobs: bool, extras=None, allowed=None, fetch: bool = True):
        """The sampler as its own program (compiled once per batch size, shared by every token
        bucket); only the sampled tokens come back to the host. ``extras``: the arguments of
        ``adjust_logits`` (``_adjusted_arrays``), None when no row needs it; ``allowed`` the tokens
        ``mask_logits`` keeps (``_allowed_array``), None when no row has a grammar."""
        flag = np.bool_(want_logprobs)
        adjusted = logits if extras is None else adjust_logits(logits, *extras)
        if allowed is not None:
            adjusted = mask_logits(adjusted, allowed)
        # deterministic mode's batch-invariant form: logprobs summed in an order fixed per row
        invariant = getattr(self.executor, "expert_impl", None) == "cpu_kernel_invariant"
        result = (sample_invariant if invariant else sample)(adjusted, logits, *sampling, flag)
        return jax.device_get(result) if fetch else result  # one host transfer for all five

    def _pause_state_bytes(self, num_tokens: int) -> int:
        """What a pause keeps on the device: the step's hidden states [B, T, D]; inside a MoE layer
        (per-expert queues) also the experts' input, the float32 partial outputs and the queues."""
        ex, cfg = self.executor, self.executor.cfg
        hidden = num_tokens * cfg.hidden_size * jax.tree.leaves(ex.cache)[0].dtype.itemsize
        if not getattr(ex, "expert_rounds", None):  # per-expert queues (``ExpertQueueing``; no isinstance per step)
            return hidden
        return 2 * hidden + num_tokens * (cfg.hidden_size * 4 + cfg.moe.top_k * 8)


@dataclasses.dataclass
class Launched:
    """A step dispatched by ``ModelRunner.launch`` and not read yet: per program call, its rows'
    indices, their padded rows and the sampler's outputs on the device."""

    rows: list[Row]
    calls: list[tuple[list[int], np.ndarray, tuple]]

    def __post_init__(self):
        # row index -> (call, padded row): where its sampled token lies
        self.at = {i: (k, int(w)) for k, (group, where, _) in enumerate(self.calls) for i, w in zip(group, where)}


def _unpack(rows: list[Row], where, result) -> list[Sampled | None]:
    """Each row's ``Sampled`` (None: a row that samples nothing) from a call's host sampler outputs."""
    tokens, chosen, rank, top_ids, top_lp = result
    out: list[Sampled | None] = []
    for i, r in zip(where, rows):
        if r.sampling is None:
            out.append(None)
            continue
        n = r.sampling.logprobs
        top = [(int(t), float(lp)) for t, lp in zip(top_ids[i, : n or 0], top_lp[i, : n or 0])]
        out.append(Sampled(int(tokens[i]), float(chosen[i]), top, None if n is None else int(rank[i])))
    return out


def _fed_tokens(tokens: np.ndarray, fed: list[int | None], where, feed: Launched):
    """``tokens`` [B, T] of a call with the first token of each fed row (``fed``: the row of ``feed``
    whose sampled token it takes, or None) from ``feed``'s sampled tokens, on the device; the host
    array itself when no row is fed."""
    out = tokens
    for k, (_, _, result) in enumerate(feed.calls):
        src = np.full(tokens.shape[0], -1, np.int32)
        for w, f in zip(where, fed):
            if f is not None and feed.at[f][0] == k:
                src[w] = feed.at[f][1]
        if (src >= 0).any():
            out = _feed(out, result[0], src)
    return out


@jax.jit
def _feed(tokens, sampled, src):
    """``tokens`` [B, T] with column 0 of the rows where ``src`` [B] >= 0 set to ``sampled[src]``."""
    taken = sampled[jnp.maximum(src, 0)].astype(tokens.dtype)
    return tokens.at[:, 0].set(jnp.where(src >= 0, taken, tokens[:, 0]))


@jax.jit
def _score(logits, targets):
    """Logprob of ``targets`` [T] at each position of ``logits`` [1, T, V], and the top
    ``MAX_LOGPROBS`` alternatives (the caller keeps as many as asked)."""
    lp = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
    tops, ids = jax.lax.top_k(lp, min(MAX_LOGPROBS, lp.shape[-1]))
    return chosen, ids, tops


def _sampling_arrays(B: int, rows: list[Row] = (), where=()) -> tuple[np.ndarray, ...]:
    """Per padded row: temperature, top_k, top_p, min_p, seed, step (greedy for padding and unsampled rows)."""
    temperature = np.zeros(B, np.float32)
    top_k = np.zeros(B, np.int32)
    top_p = np.ones(B, np.float32)
    min_p = np.zeros(B, np.float32)
    seeds = np.zeros(B, np.uint32)
    steps = np.zeros(B, np.int32)
    for i, r in zip(where, rows):
        if r.sampling is None:
            continue
        s = r.sampling
        temperature[i], top_k[i], top_p[i], min_p[i] = s.temperature, s.top_k, s.top_p, s.min_p
        seeds[i], steps[i] = r.seed % (1 << 32), r.step
    return temperature, top_k, top_p, min_p, seeds, steps
