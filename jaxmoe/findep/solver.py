"""FinDEP's configuration search (arXiv:2512.21487, Algorithm 1) and a brute-force search over the same space.

Given a profile, a batch shape and memory limits, choose (order, m_a, r1, m_e, r2) with the highest
predicted throughput. Two readings of "the batch":

* ``mode="batch"`` (serving; the default): the step has ``batch`` sequences per attention instance
  and all of them must run. r1 micro-batches of m_a = ceil(batch / r1) sequences (the last ones
  padded); throughput counts the real tokens. For each m_a only the smallest r1 that covers the
  batch is on the (m_a, r1) frontier.
* ``mode="max"`` (the paper's offline setting): ``batch`` is the most sequences memory holds;
  r1 * m_a <= batch, throughput counts r1 * m_a. Algorithm 1's frontier: m_a from large to small,
  r1 = the largest that fits, skipping repeats (throughput grows with m_a at fixed r1 and with r1
  at fixed m_a, Theorems 1-3).

For each frontier point and order (ASAS, AASS) the step time is convex in 1/r2 (Theorem 4), so r2
is found by an integer ternary search; m_e = m_a * ag * q * top_k / (r2 * E) follows. Times come
from ``schedule.estimate``, which equals the event model ``schedule.simulate``, with the profile's
``host`` bounds when it has one (a measured CPU profile: step >= work / concurrency and >= programs x
dispatch; both are linear in r2, so still convex in 1/r2), and with a measured profile's convex
expert term (gamma x², XLA:CPU) the expert chunk costs e0 + e1 / r2 + e2 / r2², still convex in 1/r2.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

from jaxmoe.findep.profile import Profile
from jaxmoe.findep.schedule import ORDERS, StageTimes, estimate

FINDEP_ORDERS = ("ASAS", "AASS")


class PlanError(ValueError):
    """No configuration fits, or a forced configuration is impossible; the message names the value."""


@dataclasses.dataclass(frozen=True)
class BatchShape:
    batch: int  # sequences per attention instance
    tokens: int = 1  # new tokens per sequence in this step (1: decode, the prompt length: prefill)
    context: int = 0  # tokens each new token attends to (default: ``tokens``)

    def __post_init__(self):
        for name in ("batch", "tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.context, int) or self.context < 0:
            raise PlanError(f"context must be a non-negative integer, got {self.context!r}")

    @property
    def attended(self) -> int:
        return self.context or self.tokens


@dataclasses.dataclass(frozen=True)
class Limits:
    """Memory and dispatch limits of the search (None: unlimited)."""

    max_micro_batch_tokens: int | None = None  # attention side: tokens of one micro-batch (m_a * q)
    max_chunk_tokens: int | None = None  # expert side: tokens of one chunk, all attention instances
    max_r1: int = 64
    max_r2: int = 64


@dataclasses.dataclass(frozen=True)
class Plan:
    order: str
    m_a: int
    r1: int
    m_e: float
    r2: int
    time_s: float  # predicted time of one step
    tokens_per_s: float  # predicted throughput (all attention instances)
    stage_times: StageTimes
    solve_ms: float = 0.0

    def as_dict(self) -> dict:
        return {
            "order": self.order,
            "m_a": self.m_a,
            "r1": self.r1,
            "m_e": self.m_e,
            "r2": self.r2,
            "predicted_ms": self.time_s * 1e3,
            "predicted_tokens_per_s": self.tokens_per_s,
            "solve_ms": self.solve_ms,
            "stage_ms": {k: v * 1e3 for k, v in dataclasses.asdict(self.stage_times).items()},
        }


def stage_times(profile: Profile, shape: BatchShape, m_a: int, r2: int) -> StageTimes:
    """Seconds of each task for micro-batches of m_a sequences and r2 chunks."""
    s, d = profile.stages, profile.dims
    tokens = m_a * shape.tokens
    chunk = tokens / r2  # per attention instance
    nbytes = chunk * d.hidden * d.dtype_bytes
    return StageTimes(
        attention=s.attention(tokens, tokens * shape.attended),
        shared=s.shared(tokens) if s.shared is not None else 0.0,
        a2e=s.a2e(nbytes),
        expert=s.expert_time(chunk * d.attention_instances),
        e2a=s.e2a(nbytes),
        dense=s.dense(tokens) if s.dense is not None else 0.0,
    )


class _Objective:
    """Step time and throughput of a configuration, for one profile, shape and mode.

    The solver's inner loop: per m_a the attention-side times and the chunk costs' (alpha, beta / r2)
    terms are computed once; each r2 then costs a few flops plus the closed form."""

    def __init__(self, profile: Profile, shape: BatchShape, mode: str):
        if mode not in ("batch", "max"):
            raise PlanError(f"mode must be 'batch' or 'max', got {mode!r}")
        self.profile, self.shape, self.mode = profile, shape, mode
        self.layers = (profile.dims.moe_layers, profile.dims.dense_layers)
        self.host = None if profile.host is None else profile.host.host()
        self._per_m_a: dict[int, tuple] = {}

    def _terms(self, m_a: int) -> tuple:
        terms = self._per_m_a.get(m_a)
        if terms is None:
            s, d = self.profile.stages, self.profile.dims
            tokens = m_a * self.shape.tokens
            nbytes = tokens * d.hidden * d.dtype_bytes
            terms = self._per_m_a[m_a] = (
                s.attention(tokens, tokens * self.shape.attended),
                s.shared(tokens) if s.shared is not None else 0.0,
                s.dense(tokens) if s.dense is not None else 0.0,
                s.a2e.alpha,
                s.a2e.betas[0] * nbytes,
                s.expert.alpha,
                s.expert.betas[0] * tokens * d.attention_instances,
                s.e2a.alpha,
                s.e2a.betas[0] * nbytes,
                s.expert.betas[1] * (tokens * d.attention_instances) ** 2 if len(s.expert.betas) > 1 else 0.0,
            )
        return terms

    def time(self, order: str, m_a: int, r1: int, r2: int) -> tuple[float, StageTimes]:
        a, sh, dense, a0, a1, e0, e1, b0, b1, e2 = self._terms(m_a)
        times = StageTimes(a, sh, a0 + a1 / r2, e0 + e1 / r2 + e2 / (r2 * r2), b0 + b1 / r2, dense)
        return estimate(times, order, r1, r2, *self.layers, host=self.host), times

    def lower_bound(self, m_a: int, r1: int) -> float:
        """A step time no order or r2 beats: the attention group's busy time."""
        a, sh, dense = self._terms(m_a)[:3]
        moe, dense_layers = self.layers
        return r1 * (moe * (a + sh) + dense_layers * (a + dense))

    def tokens(self, m_a: int, r1: int) -> int:
        seqs = self.shape.batch if self.mode == "batch" else m_a * r1
        return seqs * self.shape.tokens * self.profile.dims.attention_instances

    def plan(self, order: str, m_a: int, r1: int, r2: int) -> Plan:
        t, times = self.time(order, m_a, r1, r2)
        d = self.profile.dims
        m_e = m_a * d.attention_instances * self.shape.tokens * d.top_k / (r2 * d.num_experts)
        return Plan(order, m_a, r1, m_e, r2, t, self.tokens(m_a, r1) / t, times)


def _r2_range(shape: BatchShape, dims, limits: Limits, m_a: int) -> range:
    """r2 values that keep at least one token per chunk and the chunk within the expert-side limit."""
    tokens = m_a * shape.tokens
    hi = min(limits.max_r2, tokens)
    lo = 1
    if limits.max_chunk_tokens is not None:
        lo = -(-tokens * dims.attention_instances // limits.max_chunk_tokens)
    return range(lo, hi + 1)


def _fits(shape: BatchShape, limits: Limits, m_a: int, r1: int) -> bool:
    if r1 > limits.max_r1:
        return False
    return limits.max_micro_batch_tokens is None or m_a * shape.tokens <= limits.max_micro_batch_tokens


def frontier(shape: BatchShape, limits: Limits, mode: str) -> list[tuple[int, int]]:
    """The (m_a, r1) candidates Algorithm 1 visits (see the module docstring)."""
    B, points = shape.batch, []
    if mode == "batch":  # each r1 with the smallest m_a that covers the batch; a repeated m_a only pads more
        prev_m_a = 0
        for r1 in range(1, min(B, limits.max_r1) + 1):
            m_a = -(-B // r1)
            if m_a != prev_m_a and _fits(shape, limits, m_a, r1):
                points.append((m_a, r1))
            prev_m_a = m_a
        return points
    prev_r1 = 0  # "max": m_a from large to small, the largest r1 memory allows, repeats skipped (Theorem 1)
    for m_a in range(B, 0, -1):
        r1 = B // m_a
        if r1 == prev_r1:
            continue
        prev_r1 = r1
        if r1 > limits.max_r1:
            break  # r1 only grows as m_a shrinks
        if _fits(shape, limits, m_a, r1):
            points.append((m_a, r1))
    return points


def _argmin_convex(f: Callable[[int], float], lo: int, hi: int) -> int:
    """argmin of f on the integers lo..hi when f falls then rises (convex in 1/r2, Theorem 4): a binary
    search for the first x with f(x + 1) >= f(x)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if f(mid + 1) < f(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo


def solve(
    profile: Profile,
    shape: BatchShape,
    limits: Limits = Limits(),
    *,
    mode: str = "batch",
    orders: Iterable[str] = FINDEP_ORDERS,
    r1: int | None = None,
    r2: int | None = None,
) -> Plan:
    """Algorithm 1: the configuration with the highest predicted throughput.

    ``orders`` restricts the execution orders (``("PP",)`` with ``r2=1`` is the best-configured
    PPPipe); ``r1`` / ``r2`` force those values (a PlanError names a forced value that cannot run)."""
    t0 = time.perf_counter()
    obj = _Objective(profile, shape, mode)
    orders = _orders(orders)
    points = frontier(shape, limits, mode)
    if r1 is not None:
        _forced("r1", r1, 1, min(limits.max_r1, shape.batch))
        m_a = -(-shape.batch // r1) if mode == "batch" else shape.batch // r1
        points = [(m_a, r1)] if _fits(shape, limits, m_a, r1) else []
    best: tuple[float, tuple] | None = None
    for m_a, r1_ in points:
        rng = _r2_range(shape, profile.dims, limits, m_a)
        if r2 is not None:
            _forced("r2", r2, 1, max(1, m_a * shape.tokens))
            rng = range(r2, r2 + 1) if r2 in rng else range(0)
        if not rng:
            continue
        if best is not None and obj.lower_bound(m_a, r1_) / obj.tokens(m_a, r1_) >= best[0]:
            continue  # the attention group alone is busier than the best schedule found: prune (exact)
        for order in orders:

            def f(x, order=order, m_a=m_a, r1_=r1_):
                return obj.time(order, m_a, r1_, x)[0] / obj.tokens(m_a, r1_)

            best_r2 = _argmin_convex(f, rng.start, rng.stop - 1)
            score = f(best_r2)
            if best is None or score < best[0]:
                best = (score, (order, m_a, r1_, best_r2))
    if best is None:
        raise PlanError(_no_fit(shape, limits, r1, r2))
    plan = obj.plan(*best[1])
    return dataclasses.replace(plan, solve_ms=(time.perf_counter() - t0) * 1e3)


def brute_force(
    profile: Profile,
    shape: BatchShape,
    limits: Limits = Limits(),
    *,
    mode: str = "batch",
    orders: Iterable[str] = FINDEP_ORDERS,
) -> Plan:
    """Every (order, m_a, r1, r2) the limits allow (mode "max": every r1 * m_a <= batch)."""
    t0 = time.perf_counter()
    obj = _Objective(profile, shape, mode)
    B = shape.batch
    if mode == "batch":
        pairs = {(-(-B // r1), r1) for r1 in range(1, B + 1)}
    else:
        pairs = {(m_a, r1) for m_a in range(1, B + 1) for r1 in range(1, B // m_a + 1)}
    best: tuple[float, tuple] | None = None
    for m_a, r1 in sorted(pairs):
        if not _fits(shape, limits, m_a, r1):
            continue
        for r2 in _r2_range(shape, profile.dims, limits, m_a):
            for order in _orders(orders):
                score = obj.time(order, m_a, r1, r2)[0] / obj.tokens(m_a, r1)
                if best is None or score < best[0]:
                    best = (score, (order, m_a, r1, r2))
    if best is None:
        raise PlanError(_no_fit(shape, limits, None, None))
    return dataclasses.replace(obj.plan(*best[1]), solve_ms=(time.perf_counter() - t0) * 1e3)


def pppipe(profile: Profile, shape: BatchShape, limits: Limits = Limits(), *, mode: str = "batch") -> Plan:
    """The best-configured PPPipe baseline: ping-pong micro-batches, no chunking, no shared overlap."""
    return solve(profile, shape, limits, mode=mode, orders=("PP",), r2=1)


def _orders(orders: Iterable[str]) -> tuple[str, ...]:
    orders = tuple(orders)
    bad = [o for o in orders if o not in ORDERS]
    if bad or not orders:
        raise PlanError(f"order must be one of {ORDERS}, got {bad[0] if bad else 'none'!r}")
    return orders


def _forced(name: str, value, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise PlanError(f"{name}={value!r} is impossible for this batch: it must be an integer in [{lo}, {hi}]")


def _no_fit(shape: BatchShape, limits: Limits, r1, r2) -> str:
    forced = ", ".join(f"{k}={v}" for k, v in (("r1", r1), ("r2", r2)) if v is not None)
    return (
        f"no pipeline configuration fits batch={shape.batch} x tokens={shape.tokens}"
        f"{' with ' + forced if forced else ''}: max_micro_batch_tokens={limits.max_micro_batch_tokens}, "
        f"max_chunk_tokens={limits.max_chunk_tokens}, max_r1={limits.max_r1}, max_r2={limits.max_r2}"
    )
