"""Token sampling: greedy or temperature / top-k / top-p with a per-request seed, plus logprobs.

Everything is per row, so one jitted call serves a batch mixing greedy and sampled requests.
The random key of a row is derived from (seed, number of tokens generated so far): the same seed
gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOKENS_LIMIT = 1 << 20  # the context length clamps it further (``LLMEngine.add_request``)
TOP_K_LIMIT = (1 << 31) - 1
MAX_TEMPERATURE = 100.0  # far past any useful value (logits / 100 is near uniform); 1e308 would be inf on device
SEED_RANGE = (-(1 << 63), 1 << 64)  # a signed or unsigned 64-bit integer


class SamplingParamsError(ValueError):
    """A sampling setting out of its type or range; ``param`` names the field (as the OpenAI API's
    ``error.param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (names follow vLLM / OpenAI). Checked on construction, strictly:
    a wrong type is an error, never coerced (``ignore_eos="false"`` or ``max_tokens=True`` are
    refused), so nothing that reaches a step can fail it. The Python API's default is greedy
    (temperature 0); the HTTP and gRPC front ends default to the OpenAI API's 1.0."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None  # any 64-bit integer
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: chosen token's + top-n alternatives
    prompt_logprobs: int | None = None  # None: none; n >= 0: each prompt token's logprob + top-n (scoring)

    def __post_init__(self):
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)):
            stop = tuple(stop)
        else:
            raise SamplingParamsError("stop", f"must be a string or a list of strings, got {type(stop).__name__}")
        object.__setattr__(self, "stop", stop)
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise SamplingParamsError("stop_token_ids", f"must be a list of integers, got {type(ids).__name__}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        self.validate()

    def validate(self) -> None:
        """Raise ``SamplingParamsError`` naming the first field of a wrong type or out of range."""
        if self.prompt_logprobs is not None:
            _int_in("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        # 0 new tokens only makes sense when scoring the prompt (lm-evaluation-harness loglikelihood)
        _int_in("max_tokens", self.max_tokens, 0 if self.prompt_logprobs is not None else 1, MAX_TOKENS_LIMIT)
        _real_in("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _real_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _int_in("top_k", self.top_k, 0, TOP_K_LIMIT)
        if self.seed is not None:
            _int_in("seed", self.seed, SEED_RANGE[0], SEED_RANGE[1] - 1)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for i, text in enumerate(self.stop):
            if not isinstance(text, str):
                raise SamplingParamsError(f"stop[{i}]", f"must be a string, got {type(text).__name__}")
            if len(text) > MAX_STOP_LENGTH:
                raise SamplingParamsError(f"stop[{i}]", f"longer than {MAX_STOP_LENGTH} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
        for i, t in enumerate(self.stop_token_ids):
            _int_in(f"stop_token_ids[{i}]", t, 0, TOP_K_LIMIT)
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _int_in("logprobs", self.logprobs, 0, MAX_LOGPROBS)

    @property
    def seed32(self) -> int | None:
        """The seed folded to the sampler's 32-bit key (both halves of the 64-bit value count)."""
        if self.seed is None:
            return None
        s = self.seed % (1 << 64)
        return (s ^ (s >> 32)) & 0xFFFFFFFF


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _int_in(name: str, v, lo: int, hi: int) -> None:
    if not _is_int(v):
        raise SamplingParamsError(name, f"must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise SamplingParamsError(name, f"must be between {lo} and {hi}, got {v}")


def _real_in(name: str, v, lo: float, hi: float, low_open: bool = False) -> None:
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        raise SamplingParamsError(name, f"must be a number, got {v!r}")
    if not math.isfinite(v) or v < lo or v > hi or (low_open and v == lo):
        bounds = f"{'(' if low_open else '['}{lo:g}, {hi:g}]" if math.isfinite(hi) else f">= {lo:g} and finite"
        raise SamplingParamsError(name, f"must be {'in ' if math.isfinite(hi) else ''}{bounds}, got {v!r}")


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
        scaled = jax.lax.cond(
            jnp.any((top_k > 0) | (top_p < 1)), lambda l: _filter(l, top_k, top_p), lambda l: l, scaled
        )
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
        want_logprobs,
        lambda: tuple(jax.lax.top_k(logits - log_z[:, None], n)),
        lambda: (jnp.zeros((logits.shape[0], n), logits.dtype), jnp.zeros((logits.shape[0], n), jnp.int32)),
    )
    return tokens, chosen, top_ids, top_lp
