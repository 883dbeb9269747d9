"""The shapes a step is padded to, and the closed set of them that warm-up compiles.

A step's rows are padded to a power of two per attention instance (``rows``) and a prefill chunk
to a power of two of at least ``MIN_PREFILL_TOKENS`` tokens; block tables always have the same
width (attention loops over the blocks a step needs). The scheduler caps a prefill chunk at
``max_prefill_chunk`` tokens and the runner puts at most ``prefill_rows`` chunks per instance in
one program call, so the set below is every shape serving can meet: after warm-up no step compiles.
"""

from __future__ import annotations

import dataclasses

MIN_PREFILL_TOKENS = 16  # prefill chunks shorter than this pad to it


def bucket(n: int, lo: int = 1) -> int:
    """The power of two >= max(n, lo)."""
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def powers_of_two(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, ... up to bucket(hi)."""
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= 2
    return out + [bucket(hi, lo)]


@dataclasses.dataclass(frozen=True)
class ShapePlan:
    max_num_seqs: int  # decode rows per step (all instances)
    max_prefill_chunk: int  # tokens of one prefill chunk
    prefill_rows: int = 4  # prefill chunks per attention instance in one program call
    # deterministic mode: (rows per instance, tokens per row) of every call, the only shape
    fixed: tuple[int, int] | None = None

    def decode_shapes(self) -> list[tuple[int, int]]:
        """(rows per instance, tokens per row) of every decode step."""
        return [(r, 1) for r in powers_of_two(1, self.max_num_seqs)]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        rows = powers_of_two(1, self.prefill_rows)
        tokens = powers_of_two(MIN_PREFILL_TOKENS, max(self.max_prefill_chunk, MIN_PREFILL_TOKENS))
        return [(r, t) for t in tokens for r in rows]

    def shapes(self) -> list[tuple[int, int]]:
        if self.fixed is not None:
            return [self.fixed]
        return self.decode_shapes() + self.prefill_shapes()

    def shapes_for(self, sequences) -> list[tuple[int, int]]:
        """The shapes that serving ``sequences`` (the live ones) can meet first: decode with up to
        as many rows per instance as there are sequences (however they spread over the instances),
        and, while some are prefilling, prefill chunks of up to that many rows and their longest
        remaining chunk; at least the one-row decode shape. A subset of ``shapes()``, in its order."""
        if self.fixed is not None:
            return [self.fixed]
        rows = bucket(max(1, len(sequences)))
        need = [(r, t) for r, t in self.decode_shapes() if r <= rows]
        prefilling = [s.num_uncomputed for s in sequences if s.is_prefill]
        if prefilling:
            chunk_rows = bucket(min(len(prefilling), self.prefill_rows))
            tokens = bucket(min(max(prefilling), self.max_prefill_chunk), MIN_PREFILL_TOKENS)
            need += [(r, t) for r, t in self.prefill_shapes() if r <= chunk_rows and t <= tokens]
        return need
