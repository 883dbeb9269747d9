"""Token sampling: greedy or temperature / top-k / top-p with a per-request seed, plus logprobs.

Everything is per row, so one jitted call serves a batch mixing greedy and sampled requests.
The random key of a row is derived from (seed, number of tokens generated so far): the same seed
gives the same tokens whatever else is in the batch.
"""
from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp

MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (names follow vLLM / OpenAI)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: chosen token's + top-n alternatives

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")


def _filter(logits: jnp.ndarray, top_k: jnp.ndarray, top_p: jnp.ndarray) -> jnp.ndarray:
    """Mask logits [B, V] outside each row's top-k and top-p nucleus."""
    V = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    sorted_logits = jnp.where(jnp.arange(V)[None] < k[:, None], sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
    keep = before < top_p[:, None]
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def _argmax_and_max(logits: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(``jnp.argmax(logits, -1)``, max) as two plain reductions.  Same result (first index of the
    maximum; a NaN counts as the maximum), but XLA:CPU runs the (value, index) pair reduction of
    ``jnp.argmax`` as a scalar loop: ~1.1 ms of a batch-16 decode step over a 32000 vocabulary."""
    V = logits.shape[-1]
    m = jnp.max(logits, axis=-1, keepdims=True)
    hit = (logits == m) | jnp.isnan(logits)
    return jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), axis=-1), m


@jax.jit
def sample(logits, temperature, top_k, top_p, seeds, steps, want_logprobs=False):
    """Returns (tokens [B], logprob of token [B], top ids [B, MAX_LOGPROBS], top logprobs [B,
    MAX_LOGPROBS]). The top alternatives are computed only when ``want_logprobs`` (a traced flag: one
    program serves steps with and without logprobs); otherwise they are zeros."""
    logits = logits.astype(jnp.float32)
    greedy, row_max = _argmax_and_max(logits)

    def random_tokens(logits):
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        # The top-k / top-p filter sorts the vocabulary of every row (slow on CPU): only when asked.
        scaled = jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1)), lambda l: _filter(l, top_k, top_p),
                              lambda l: l, scaled)
        keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(seeds, steps)
        sampled = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return jnp.where(temperature > 0, sampled, greedy)

    # An all-greedy batch (the common serving case) skips the sort and the random draws entirely.
    tokens = jax.lax.cond(jnp.any(temperature > 0), random_tokens, lambda _: greedy, logits)
    # log p(token) = logit - logsumexp(logits), without materialising the [B, V] log-softmax
    log_z = row_max[:, 0] + jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1))
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - log_z
    n = min(MAX_LOGPROBS, logits.shape[-1])
    top_lp, top_ids = jax.lax.cond(
        want_logprobs, lambda: tuple(jax.lax.top_k(logits - log_z[:, None], n)),
        lambda: (jnp.zeros((logits.shape[0], n), logits.dtype), jnp.zeros((logits.shape[0], n), jnp.int32)))
    return tokens, chosen, top_ids, top_lp
