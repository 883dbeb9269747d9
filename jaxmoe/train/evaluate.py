"""Quality of a model on held-out text: perplexity and the routed experts' token shares.

Both run the training forward pass with no expert capacity limit, which equals the serving forward
(``tests/train/test_train.py`` checks the logits), over windows of the held-out token stream.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from jaxmoe.config import ModelConfig
from jaxmoe.brownout.routing import BrownoutRouting
from jaxmoe.train.model import forward


def _scorer(cfg: ModelConfig, brownout=None):
    """``brownout``: None, or (threshold, use_full_brownout) to score through brownout routing."""

    routing = None if brownout is None else BrownoutRouting(brownout[1])
    threshold = None if brownout is None else jnp.float32(brownout[0])

    def score(params, window):
        logits, stats = forward(params, cfg, window[None, :-1], 0.0, routing, threshold)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits[0], window[1:]).sum()
        counts = stats["counts"] if stats else jnp.zeros((0,), jnp.int32)
        return nll, counts

    return jax.jit(score)


def perplexity(cfg: ModelConfig, params: dict, windows: np.ndarray, progress: bool = True, brownout=None) -> dict:
    """``{"perplexity", "loss" (mean nats per token), "tokens"}`` over windows [N, T + 1]
    (``brownout``: (threshold, use_full_brownout), the params holding united experts)."""
    score = _scorer(cfg, brownout)
    total, tokens = 0.0, 0
    for window in tqdm(windows, desc="held-out", unit="window", disable=not progress):
        nll, _ = score(params, jnp.asarray(window))
        total += float(nll)
        tokens += len(window) - 1
    loss = total / tokens
    return {"perplexity": math.exp(loss), "loss": loss, "tokens": tokens}


def expert_token_share(cfg: ModelConfig, params: dict, windows: np.ndarray) -> list[list[float]]:
    """Per MoE layer: the share of top-k assignments each expert received (1 / E each when even)."""
    score = _scorer(cfg)
    counts = None
    for window in windows:
        _, c = score(params, jnp.asarray(window))
        c = np.asarray(c, np.int64)
        counts = c if counts is None else counts + c
    if counts is None or counts.size == 0:
        return []
    return (counts / counts.sum(axis=-1, keepdims=True)).tolist()
