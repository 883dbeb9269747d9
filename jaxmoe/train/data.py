"""Token streams and training batches.

A split's documents are encoded (each starts with ``<|endoftext|>``, the tokenizer's post-processor
adds it) and concatenated into one int32 stream.  The batch of step s is ``batch_size`` windows of
``seq_len + 1`` tokens at offsets drawn from a generator seeded by (seed, s): any step's batch can be
rebuilt from the step number alone, so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def encode_documents(tokenizer, texts: Sequence[str], batch: int = 256) -> np.ndarray:
    """One int32 stream of the texts' token ids (a ``tokenizers.Tokenizer``: ``encode_batch`` runs in
    parallel; jaxmoe's ``HFTokenizer`` / any object with ``encode`` works too)."""
    pieces = []
    for start in range(0, len(texts), batch):
        chunk = list(texts[start : start + batch])
        if hasattr(tokenizer, "encode_batch"):
            pieces += [np.asarray(e.ids, np.int32) for e in tokenizer.encode_batch(chunk)]
        else:
            pieces += [np.asarray(tokenizer.encode(t), np.int32) for t in chunk]
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


def batch_at(stream: np.ndarray, step: int, seed: int, batch_size: int, seq_len: int) -> np.ndarray:
    """[batch_size, seq_len + 1] windows of the stream for training step ``step``."""
    if len(stream) < seq_len + 1:
        raise ValueError(f"the training text has {len(stream)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len, size=batch_size)
    return np.stack([stream[s : s + seq_len + 1] for s in starts])


def eval_windows(stream: np.ndarray, seq_len: int, max_tokens: int = 0) -> np.ndarray:
    """Consecutive non-overlapping windows [N, seq_len + 1] (window i starts at i * seq_len: every token
    after the first is predicted exactly once); a short stream gives one shorter window.
    ``max_tokens`` > 0 keeps about that many predicted tokens."""
    if max_tokens:
        stream = stream[: max_tokens + 1]
    if len(stream) < 2:
        raise ValueError("the evaluation text has fewer than 2 tokens")
    seq_len = min(seq_len, len(stream) - 1)
    n = (len(stream) - 1) // seq_len
    return np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
