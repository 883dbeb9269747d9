"""Turns one scheduled step (rows of tokens with their positions and block tables) into padded
device arrays, runs the executor (monolithic or disaggregated) and samples the next tokens.

Shapes are bucketed to powers of two (rows, tokens per row — at least 16 for a prefill chunk —,
blocks per row) so a serving run compiles a handful of programs, not one per batch; a step mixing
decodes and prefill chunks runs them as two batches (``run``).

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

import jax
import numpy as np

from jaxmoe.engine.sampler import MAX_LOGPROBS, SamplingParams, sample
from jaxmoe.models.attention import AttentionBatch


@dataclasses.dataclass
class Row:
    """One sequence's work in a step: ``token_ids`` at positions ``start``.. of the sequence."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    sampling: SamplingParams | None = None  # None: no token is sampled (a non-final prefill chunk)
    seed: int = 0
    step: int = 0  # tokens generated so far (varies the random key)


@dataclasses.dataclass
class Sampled:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top alternatives (token id, logprob), when asked


MIN_PREFILL_BUCKET = 16  # prefill chunks shorter than this pad to it: fewer programs to compile


def _bucket(n: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


class ModelRunner:
    def __init__(self, executor, block_size: int, max_blocks_per_seq: int):
        self.executor = executor
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_instances = m = getattr(executor, "num_attention", 1)
        # blocks in each attention instance's KV slot range (instance j: blocks j*n .. (j+1)*n)
        self.blocks_per_instance = executor.num_cache_slots // (m * block_size) if m > 1 else 0

    def placement(self, rows: list[Row]) -> tuple[np.ndarray, int]:
        """(padded row of each row [len(rows)], padded rows B): rows of instance j at j*R.., B = m*R."""
        m = self.num_instances
        inst = [r.block_table[0] // self.blocks_per_instance for r in rows] if m > 1 else [0] * len(rows)
        R = _bucket(int(np.bincount(inst, minlength=m).max()))
        where, used = [], [0] * m
        for j in inst:
            where.append(j * R + used[j])
            used[j] += 1
        return np.array(where), m * R

    def prepare(self, rows: list[Row]):
        """Padded (tokens [B, T], AttentionBatch, logits_index [B]) for the rows, and each row's
        padded row ``where`` [len(rows)] (see ``placement``)."""
        where, B = self.placement(rows)
        longest = max(len(r.token_ids) for r in rows)
        T = 1 if longest == 1 else _bucket(longest, MIN_PREFILL_BUCKET)
        NB = min(_bucket(max(len(r.block_table) for r in rows)), _bucket(self.max_blocks_per_seq))
        tokens = np.zeros((B, T), np.int32)
        positions = np.zeros((B, T), np.int32)
        slots = np.full((B, T), -1, np.int32)
        first = np.arange(B, dtype=np.int32) // (B // self.num_instances) * self.blocks_per_instance
        tables = np.repeat(first[:, None], NB, axis=1)  # padding entries: the instance's first block
        last = np.zeros((B,), np.int32)
        for i, r in zip(where, rows):
            n = len(r.token_ids)
            pos = np.arange(r.start, r.start + n)
            table = np.asarray(r.block_table, np.int32)
            tokens[i, :n] = r.token_ids
            positions[i, :n] = pos
            slots[i, :n] = table[pos // self.block_size] * self.block_size + pos % self.block_size
            tables[i, : len(table)] = table
            last[i] = n - 1
        return tokens, AttentionBatch(positions, slots, tables), last, where

    def warm_decode(self, batch_size: int, blocks: int) -> None:
        """Compile (by running) the decode program for ``batch_size`` rows with block tables
        ``blocks`` wide, on dummy rows spread over the attention instances. Each row writes one
        KV slot (the first of its instance's first block): only while no sequence holds KV."""
        m, per = self.num_instances, self.blocks_per_instance
        greedy = SamplingParams(max_tokens=1)
        self.run([Row([0], 0, [(j % m) * per] * blocks, greedy) for j in range(batch_size)])

    def forward(self, rows: list[Row], all_logits: bool = False):
        """Logits of the rows, in their order: [len(rows), V] at each row's last token, or
        [len(rows), T, V] with ``all_logits``."""
        tokens, batch, last, where = self.prepare(rows)
        return self.executor.forward(tokens, batch, None if all_logits else last)[where]

    def run(self, rows: list[Row]) -> list[Sampled | None]:
        """One step: forward every row, sample a token for rows that have sampling params.

        A step that mixes decodes (one token per row) with prefill chunks runs as two batches,
        decodes and prefills: one padded [B, T] batch would pad every decode row to the longest
        chunk (16 decodes beside a 256-token chunk: 4096 token slots for 272 tokens).
        """
        single = [len(r.token_ids) == 1 for r in rows]
        if any(single) and not all(single):
            groups = [[i for i, one in enumerate(single) if one], [i for i, one in enumerate(single) if not one]]
            out: list[Sampled | None] = [None] * len(rows)
            for group in groups:
                for i, sampled in zip(group, self._run([rows[i] for i in group])):
                    out[i] = sampled
            return out
        return self._run(rows)

    def _run(self, rows: list[Row]) -> list[Sampled | None]:
        """Forward + sample one padded batch. With an executor that has ``forward_sample`` (the
        monolithic one) the forward pass and the sampler run as one jitted program and only the
        sampled tokens come back to the host."""
        tokens_in, batch, last, where = self.prepare(rows)
        B = tokens_in.shape[0]
        temperature = np.zeros(B, np.float32)
        top_k = np.zeros(B, np.int32)
        top_p = np.ones(B, np.float32)
        seeds = np.zeros(B, np.uint32)
        steps = np.zeros(B, np.int32)
        want_logprobs = 0
        for i, r in zip(where, rows):
            if r.sampling is None:
                continue
            s = r.sampling
            temperature[i], top_k[i], top_p[i] = s.temperature, s.top_k, s.top_p
            seeds[i], steps[i] = r.seed % (1 << 32), r.step
            if s.logprobs is not None:
                want_logprobs = MAX_LOGPROBS
        sampling = (temperature, top_k, top_p, seeds, steps)
        fused = getattr(self.executor, "forward_sample", None)
        if fused is not None:
            result = fused(tokens_in, batch, last, *sampling, num_logprobs=want_logprobs)
        else:
            logits = self.executor.forward(tokens_in, batch, last)
            result = sample(logits, *sampling, num_logprobs=want_logprobs)
        tokens, chosen, top_ids, top_lp = jax.device_get(result)  # one host transfer for all four
        out: list[Sampled | None] = []
        for i, r in zip(where, rows):
            if r.sampling is None:
                out.append(None)
                continue
            n = r.sampling.logprobs or 0
            top = [(int(t), float(lp)) for t, lp in zip(top_ids[i, :n], top_lp[i, :n])]
            out.append(Sampled(int(tokens[i]), float(chosen[i]), top))
        return out
