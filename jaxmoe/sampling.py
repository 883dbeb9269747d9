"""Token sampling: greedy or temperature / top-k / top-p / min-p with a per-request seed, logit
bias and presence / frequency / repetition penalties, plus logprobs.

Everything is per row, so one jitted call serves a batch mixing greedy and sampled requests.
The random key of a row is derived from (seed, number of tokens generated so far): the same seed
gives the same tokens whatever else is in the batch.

``sample`` draws the tokens (temperature, top-k, top-p, min-p: each filter behind a cond, so a
batch that does not use it does not pay for it). Logit bias and penalties are ``adjust_logits``, a
small program of its own that a step runs before ``sample`` only when one of its rows asks for one
(``SamplingParams.adjusts_logits``): it takes each row's token history (prompt + output ids, padded
to a fixed width so one program serves every step of a batch size) and counts the tokens on the
device. Structured output (``structured_outputs``: ``jaxmoe.structured_output``) is ``mask_logits``,
another small program run only in steps where a row has a grammar: it keeps the tokens of each
row's bitmask of allowed tokens. Logprobs are those of the model's own distribution (before bias, penalties and
temperature), as vLLM's default.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

from jaxmoe.pallas_kernels.expert_ffn.cpu_kernel import invariant_sum, program_jit
from jaxmoe.structured_output import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 256  # entries of logit_bias (one fixed width: one program)
MAX_N = 128  # completions per request (n, best_of)
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
    refused), so nothing that reaches a step can fail it. The default is greedy (temperature 0);
    see docs/serving.md for what each front end fills in when a request leaves a field unset.

    ``n`` completions per prompt (``best_of`` >= n are generated and the n with the highest
    cumulative logprob are returned); each is its own request sharing the prompt, completion i
    seeded with ``seed + i`` (``for_index``). Penalties as in vLLM / OpenAI: ``presence_penalty``
    and ``frequency_penalty`` in [-2, 2] subtract from the logit of each token already generated
    (once, or per occurrence); ``repetition_penalty`` > 0 divides positive (multiplies negative)
    logits of tokens in the prompt or the output (1 = off). ``min_p`` in [0, 1] drops tokens less
    likely than min_p times the most likely one. ``logit_bias``: {token id: bias in [-100, 100]}
    added to the logits. ``structured_outputs``: what the output must match (a JSON schema, any
    JSON object, a regex, a choice, a grammar: ``jaxmoe.structured_output``), as vLLM's."""

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
    n: int = 1
    best_of: int | None = None  # None: n
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

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
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise SamplingParamsError(
                    "logit_bias", f"must be a mapping of token id to bias, got {type(bias).__name__}"
                )
            object.__setattr__(self, "logit_bias", dict(bias))
        self.validate()

    def __hash__(self):  # logit_bias is a dict: hash its items
        fields = dataclasses.astuple(dataclasses.replace(self, logit_bias=None, structured_outputs=None))
        return hash((fields, tuple(sorted((self.logit_bias or {}).items())), self.structured_outputs))

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
        _int_in("n", self.n, 1, MAX_N)
        if self.best_of is not None:
            _int_in("best_of", self.best_of, self.n, MAX_N)
        _real_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _real_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _real_in("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)
        _real_in("min_p", self.min_p, 0.0, 1.0)
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise SamplingParamsError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
            for t, b in self.logit_bias.items():
                _int_in(f"logit_bias[{t!r}]", t, 0, TOP_K_LIMIT)
                _real_in(f"logit_bias[{t}]", b, -100.0, 100.0)
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise SamplingParamsError(
                    "structured_outputs", f"must be a StructuredOutputsParams, got {type(so).__name__}"
                )
            try:
                so.validate()
            except ValueError as e:
                raise SamplingParamsError(so.param, str(e)) from None

    @property
    def adjusts_logits(self) -> bool:
        """Whether this request needs ``adjust_logits`` (logit bias or penalties)."""
        return bool(
            self.logit_bias or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def num_sequences(self) -> int:
        """Requests generated for this one (``best_of``, else ``n``)."""
        return self.best_of or self.n

    def for_index(self, i: int) -> SamplingParams:
        """The settings of completion ``i`` of ``num_sequences``: one sequence, seed ``seed + i``
        (wrapped into the 64-bit range) so the completions differ but each is reproducible."""
        seed = self.seed
        if seed is not None and seed + i >= SEED_RANGE[1]:
            seed -= 1 << 64
        seed = None if seed is None else seed + i
        return dataclasses.replace(self, n=1, best_of=None, seed=seed)

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


def _filter(logits: jnp.ndarray, top_k: jnp.ndarray, top_p: jnp.ndarray, invariant: bool = False) -> jnp.ndarray:
    """Mask logits [B, V] outside each row's top-k and top-p nucleus (a row with top_p 1 keeps its
    top-k whole). ``invariant`` (deterministic mode): the softmax's sum and the running sum of the
    sorted probabilities in an order fixed per row (``invariant_sum``; a scan of element-wise adds),
    so a row's nucleus does not depend on the other rows."""
    V = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    sorted_logits = jnp.where(jnp.arange(V)[None] < k[:, None], sorted_logits, -jnp.inf)
    if invariant:
        exp = jnp.exp(sorted_logits - sorted_logits[:, :1])  # sorted: the first is the row's max
        probs = exp / invariant_sum(exp)[:, None]
        before = jax.lax.associative_scan(jnp.add, probs, axis=-1) - probs
    else:
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
    keep = (before < top_p[:, None]) | (top_p[:, None] >= 1)
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


def _min_p(scaled, min_p):
    """Drop tokens with p < min_p * p_max, i.e. logit < max + log(min_p) (rows with min_p 0 keep all)."""
    floor = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
    return jnp.where((min_p[:, None] > 0) & (scaled < floor), -jnp.inf, scaled)


def _choose(logits, temperature, top_k, top_p, seeds, steps, min_p, invariant: bool = False):
    """The token of each row of ``logits`` [B, V] (float32): greedy where temperature is 0;
    ``invariant``: each row's draw whatever the other rows (``_filter``)."""
    greedy, _ = _argmax_and_max(logits)

    def random_tokens(logits):
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        scaled = jax.lax.cond(jnp.any(min_p > 0), lambda l: _min_p(l, min_p), lambda l: l, scaled)
        # The top-k / top-p filter sorts the vocabulary of every row (slow on CPU): only when asked.
        scaled = jax.lax.cond(
            jnp.any((top_k > 0) | (top_p < 1)), lambda l: _filter(l, top_k, top_p, invariant), lambda l: l, scaled
        )
        keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(seeds, steps)
        sampled = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return jnp.where(temperature > 0, sampled, greedy)

    # An all-greedy batch (the common serving case) skips the sort and the random draws entirely.
    return jax.lax.cond(jnp.any(temperature > 0), random_tokens, lambda _: greedy, logits)


def _logprobs(logits, tokens, want_logprobs, invariant: bool = False):
    """(logprob of each row's token [B], its rank [B] (1 = the most likely), top ids [B, n], top
    logprobs [B, n]) under ``logits``; rank and top only when ``want_logprobs`` (else zeros).
    ``invariant``: the logsumexp summed in an order fixed per row (``invariant_sum``; XLA's sum over
    the vocabulary changes order with the number of rows)."""
    _, row_max = _argmax_and_max(logits)
    # log p(token) = logit - logsumexp(logits), without materialising the [B, V] log-softmax
    exp = jnp.exp(logits - row_max)
    log_z = row_max[:, 0] + jnp.log(invariant_sum(exp) if invariant else jnp.sum(exp, axis=-1))
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    chosen = picked - log_z
    B, n = logits.shape[0], min(MAX_LOGPROBS, logits.shape[-1])
    rank, top_lp, top_ids = jax.lax.cond(
        want_logprobs,
        lambda: (
            1 + jnp.sum(logits > picked[:, None], axis=-1, dtype=jnp.int32),
            *jax.lax.top_k(logits - log_z[:, None], n),
        ),
        lambda: (jnp.zeros((B,), jnp.int32), jnp.zeros((B, n), logits.dtype), jnp.zeros((B, n), jnp.int32)),
    )
    return chosen, rank, top_ids, top_lp


def _sample(logits, raw_logits, temperature, top_k, top_p, min_p, seeds, steps, want_logprobs=False, invariant=False):
    logits = logits.astype(jnp.float32)
    raw_logits = raw_logits.astype(jnp.float32)
    tokens = _choose(logits, temperature, top_k, top_p, seeds, steps, min_p, invariant)
    return (tokens, *_logprobs(raw_logits, tokens, want_logprobs, invariant))


@jax.jit
def sample(logits, raw_logits, temperature, top_k, top_p, min_p, seeds, steps, want_logprobs=False):
    """Returns (tokens [B], logprob of token [B], rank of token [B], top ids [B, MAX_LOGPROBS], top
    logprobs [B, MAX_LOGPROBS]). Tokens are drawn from ``logits`` (``adjust_logits``' output, or the
    model's logits themselves); logprobs, rank and the top alternatives are those of ``raw_logits``
    (the model's). Rank and the top alternatives are computed only when ``want_logprobs`` (a traced
    flag: one program serves steps with and without logprobs); otherwise they are zeros."""
    return _sample(logits, raw_logits, temperature, top_k, top_p, min_p, seeds, steps, want_logprobs)


@program_jit(True)
def sample_invariant(logits, raw_logits, temperature, top_k, top_p, min_p, seeds, steps, want_logprobs=False):
    """``sample`` with each row's logprobs and its top-k / top-p / min-p draw computed in an order that
    does not depend on the other rows (deterministic mode; greedy tokens are an exact argmax in both)."""
    return _sample(logits, raw_logits, temperature, top_k, top_p, min_p, seeds, steps, want_logprobs, True)


@jax.jit
def adjust_logits(logits, presence, frequency, repetition, history, num_prompt, bias_ids, bias_values):
    """Logit bias, then presence / frequency / repetition penalties (vLLM's order), per row:
    ``presence`` / ``frequency`` / ``repetition`` [B]; ``history`` [B, W] the prompt then the output
    ids (padding: -1), ``num_prompt`` [B] how many of them are the prompt; ``bias_ids`` /
    ``bias_values`` [B, K] (padding id: -1). A small program of its own (a scatter and a few
    element-wise ops), run before ``sample`` only for steps where a request sets one of them."""
    raw = logits.astype(jnp.float32)
    B, V = raw.shape
    rows = jnp.arange(B)[:, None]
    valid = history >= 0
    ids = jnp.where(valid, history, V)  # padding lands out of range and is dropped
    is_output = valid & (jnp.arange(history.shape[1])[None] >= num_prompt[:, None])
    counts = jnp.zeros((B, V), jnp.float32).at[rows, ids].add(is_output.astype(jnp.float32), mode="drop")
    seen = jnp.zeros((B, V), jnp.bool_).at[rows, ids].max(valid, mode="drop")
    adjusted = raw.at[rows, jnp.where(bias_ids >= 0, bias_ids, V)].add(bias_values, mode="drop")
    rep = repetition[:, None]
    adjusted = jnp.where(seen, jnp.where(adjusted > 0, adjusted / rep, adjusted * rep), adjusted)
    return adjusted - frequency[:, None] * counts - presence[:, None] * (counts > 0)


@jax.jit
def mask_logits(logits, allowed):
    """Keep, in each row of ``logits`` [B, V], the tokens whose bit is set in ``allowed`` [B, W]
    int32 (bit ``t % 32`` of word ``t // 32``; rows without a grammar: every bit set); the others
    become -inf. Structured output's program, run before ``sample`` only in steps that need it."""
    ids = jnp.arange(logits.shape[-1])
    keep = (jnp.take(allowed, ids // 32, axis=1) >> (ids % 32)) & 1
    return jnp.where(keep.astype(jnp.bool_), logits, -jnp.inf).astype(logits.dtype)
