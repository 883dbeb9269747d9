"""The time of one disaggregated step under a pipeline schedule: an exact event model and a closed form.

Tasks of one MoE layer t (FinDEP, arXiv:2512.21487, section 3): the attention instances split their
batch into r1 micro-batches of m_a sequences; micro-batch i runs attention A(t,i) and shared experts
S(t,i) on the attention group (AG); its activations go to the experts in r2 chunks, each chunk j
through three resources in turn: the A2E link, the expert group (EG), the E2A link. Micro-batch i
enters layer t+1 when all its chunks are back and S(t,i) is done. Every resource runs one task at a
time in a fixed order:

* AG, per layer: ``ASAS`` = A0 S0 A1 S1 ...; ``AASS`` = A0 A1 ... S0 S1 ...; ``PP`` (PPPipe,
  MegaScale-Infer's ping-pong pipeline, and with r1 = r2 = 1 the plain sequential schedule) = A0 S0
  A1 S1 ... with a micro-batch's A2E waiting for its shared experts too (no shared-expert overlap).
* links and EG: chunks first come, first served, in (layer, micro-batch, chunk) order.

``simulate`` computes every task's start and end exactly (a list schedule: each task starts when its
resource is free and its inputs are ready); a chunk's three-stage flow has a closed form, so a layer
costs O(r1) and a run of identical layers is extrapolated once its per-layer increment repeats.
``estimate`` is the closed form the solver searches with (the shape of the paper's eq. 12-13, with
E2A counted, the chunk tail counted once, and a separate AASS form), checked against ``simulate``
in the tests.

Both assume what the paper's hardware gives: the attention group, the links and the expert group are
separate hardware, so their tasks overlap. On a host where they share the same cores (the CPU mesh:
8 host "devices" on 2 cores, one XLA:CPU thread pool) that overlap does not happen, and every task
costs the host a dispatch. A ``Host`` (measured by ``jaxmoe profile``; ``None``: separate hardware,
the paper's model unchanged) adds two bounds to the step time:

* ``concurrency`` c: how many tasks' worth of work the hardware advances at once (1: one at a
  time; >= 4: as many as there are resources). The step cannot end before all its work W (the sum
  of its task times) has been done at that rate: step >= W / c. With c = 1 a step is the serial sum
  of its tasks, whatever the schedule.
* ``dispatch`` d: host seconds to dispatch one program (JAX dispatches asynchronously but one program
  at a time): step >= N d for the N programs the executor dispatches (``programs``).

so the step time is ``max(event model, W / c, N d)``.

``dispatch_order`` turns the event model into the order in which the disaggregated executor
dispatches a step's programs (``runtime.pipeline.Pipeline.dispatch``): every task by its start
time in the event model. A device that runs its programs in the order they were dispatched then
runs them in the event model's order: chunk j's E2A right after its expert program (before chunk
j+1's), and layer t+1's attention of micro-batch 0 before the last micro-batch's experts of layer
t when the model starts it first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

ORDERS = ("ASAS", "AASS", "PP")
RESOURCES = ("attention", "a2e", "expert", "e2a")  # AG, A2E link, EG, E2A link


@dataclasses.dataclass(frozen=True)
class StageTimes:
    """Seconds per task: attention / shared / dense MLP per micro-batch; a2e / expert / e2a per chunk."""

    attention: float
    shared: float
    a2e: float
    expert: float
    e2a: float
    dense: float = 0.0  # the MLP of a dense layer (no expert part), per micro-batch


@dataclasses.dataclass(frozen=True)
class Host:
    """What the hardware running the tasks can overlap (see the module docstring)."""

    concurrency: float  # tasks that progress at full speed at once (>= 1)
    dispatch: float = 0.0  # host seconds per dispatched program

    def __post_init__(self):
        if not self.concurrency >= 1.0:
            raise ValueError(f"host concurrency must be >= 1, got {self.concurrency!r}")
        if not self.dispatch >= 0.0:
            raise ValueError(f"host dispatch must be >= 0 seconds, got {self.dispatch!r}")


@dataclasses.dataclass(frozen=True)
class Event:
    resource: str  # one of RESOURCES
    task: str  # "attention" | "shared" | "dense" | "a2e" | "expert" | "e2a"
    layer: int
    micro_batch: int
    chunk: int  # -1 for attention-side tasks
    start: float
    end: float


def layer_kinds(moe_layers: int, dense_layers: int) -> tuple[bool, ...]:
    """Per layer: MoE (True) or dense (False); dense layers first, as in DeepSeek."""
    return (False,) * dense_layers + (True,) * moe_layers


def _flow(release: float, free: list[float], p: tuple[float, float, float], n: int) -> None:
    """n identical chunks through three machines (times p), all released at ``release``; machine k
    free at ``free[k]``. Updates ``free`` to when each machine finishes the last chunk.

    Longest-path form of a permutation flow shop with identical jobs: the last completion on machine
    k is max over the machine m <= k where the critical path starts of
    start_m + sum(p[m..k]) + (n - 1) * max(p[m..k]).
    """
    p1, p2, p3 = p
    s1 = max(release, free[0])
    c1 = s1 + n * p1
    c2 = max(s1 + p1 + p2 + (n - 1) * max(p1, p2), free[1] + n * p2)
    c3 = max(s1 + p1 + p2 + p3 + (n - 1) * max(p1, p2, p3), free[1] + p2 + p3 + (n - 1) * max(p2, p3), free[2] + n * p3)
    free[0], free[1], free[2] = c1, c2, c3


def simulate(
    times: StageTimes,
    order: str,
    r1: int,
    r2: int,
    layers: Sequence[bool],
    timeline: bool = False,
    host: Host | None = None,
) -> tuple[float, list[Event]]:
    """(makespan in seconds, events if ``timeline``) of one step over ``layers`` (MoE: True).

    With a ``host`` the makespan is also bounded by the host's work and dispatch bounds (module
    docstring); the events stay the separate-hardware timeline.

    Without a timeline, once two consecutive layers of the same kind advance every resource and
    micro-batch by the same amount, the rest of that run of layers is extrapolated (exact: the
    state after a layer is a max-plus function of the state before it, shifted by its increment)."""
    _check(order, r1, r2)
    ag, links, ready = 0.0, [0.0, 0.0, 0.0], [0.0] * r1
    events: list[Event] = []
    prev_delta: tuple[float, ...] | None = None
    t = 0
    while t < len(layers):
        before = (ag, *links, *ready)
        ag = _layer(times, order, r1, r2, layers[t], t, ag, links, ready, events if timeline else None)
        delta = tuple(b - a for a, b in zip(before, (ag, *links, *ready)))
        t += 1
        steady = prev_delta is not None and layers[t - 1] == layers[t - 2] and _same(delta, prev_delta)
        prev_delta = delta
        if steady and not timeline:
            run = 0
            while t + run < len(layers) and layers[t + run] == layers[t - 1]:
                run += 1
            ag += run * delta[0]
            links[:] = [v + run * d for v, d in zip(links, delta[1:4])]
            ready[:] = [v + run * d for v, d in zip(ready, delta[4:])]
            t += run
            prev_delta = None
    makespan = max(ready + [ag])
    if host is not None:
        moe = sum(1 for k in layers if k)
        makespan = max(makespan, _host_bound(times, r1, r2, moe, len(layers) - moe, host))
    return makespan, events


def work(times: StageTimes, r1: int, r2: int, moe_layers: int, dense_layers: int = 0) -> float:
    """Seconds of all the tasks of one step added up (what one-at-a-time hardware takes)."""
    moe = times.attention + times.shared + r2 * (times.a2e + times.expert + times.e2a)
    return r1 * (moe_layers * moe + dense_layers * (times.attention + times.dense))


def programs(times: StageTimes, r1: int, r2: int, moe_layers: int, dense_layers: int = 0) -> int:
    """Programs the disaggregated executor dispatches for one step: per micro-batch the embedding and
    the head, per layer its attention program, and in a MoE layer the shared experts (when they
    cost anything), r2 x (A2E, experts, E2A) and, with r2 > 1, the split and the join of the chunks."""
    per_moe = 1 + (times.shared > 0) + 3 * r2 + (2 if r2 > 1 else 0)
    return r1 * (2 + moe_layers * per_moe + dense_layers)


def _host_bound(times: StageTimes, r1: int, r2: int, moe_layers: int, dense_layers: int, host: Host) -> float:
    return max(
        work(times, r1, r2, moe_layers, dense_layers) / host.concurrency,
        programs(times, r1, r2, moe_layers, dense_layers) * host.dispatch,
    )


def _same(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    scale = max(1e-12, *(abs(x) for x in a))
    return all(abs(x - y) <= 1e-9 * scale for x, y in zip(a, b))


def _layer(
    times: StageTimes,
    order: str,
    r1: int,
    r2: int,
    moe: bool,
    t: int,
    ag: float,
    links: list[float],
    ready: list[float],
    events: list[Event] | None,
) -> float:
    """One layer: AG tasks in the order's sequence, then each micro-batch's chunk flow (FIFO)."""
    second = times.shared if moe else times.dense
    second_name = "shared" if moe else "dense"
    if order == "AASS":
        seq = [(0, i) for i in range(r1)] + [(1, i) for i in range(r1)]
    else:
        seq = [(k, i) for i in range(r1) for k in (0, 1)]
    a_end = [0.0] * r1
    s_end = [0.0] * r1
    for kind, i in seq:
        if kind == 0:
            start = max(ag, ready[i])
            ag = a_end[i] = start + times.attention
            name = "attention"
        else:
            start = max(ag, a_end[i])
            ag = s_end[i] = start + second
            name = second_name
        if events is not None and ag > start:
            events.append(Event("attention", name, t, i, -1, start, ag))
    p = (times.a2e, times.expert, times.e2a)
    for i in range(r1):
        if not moe:
            ready[i] = s_end[i]
            continue
        release = s_end[i] if order == "PP" else a_end[i]
        if events is not None:  # chunk by chunk, for the picture
            for j in range(r2):
                free = links
                s1 = max(release, free[0])
                c1 = s1 + p[0]
                s2 = max(c1, free[1])
                c2 = s2 + p[1]
                s3 = max(c2, free[2])
                c3 = s3 + p[2]
                for res, s, e in (("a2e", s1, c1), ("expert", s2, c2), ("e2a", s3, c3)):
                    events.append(Event(res, res, t, i, j, s, e))
                links[0], links[1], links[2] = c1, c2, c3
        else:
            _flow(release, links, p, r2)
        ready[i] = max(links[2], s_end[i])
    return ag


def estimate(
    times: StageTimes,
    order: str,
    r1: int,
    r2: int,
    moe_layers: int,
    dense_layers: int = 0,
    host: Host | None = None,
) -> float:
    """Closed-form step time (seconds): T MoE layers of per-layer period D, the last one's tail, and
    the dense layers (attention side only); with a ``host``, at least its bounds (module docstring).

    With X = t_a + t_s, Y = max(t_a2e, t_e, t_e2a), the chunk latency L = t_a2e + t_e + t_e2a +
    (r2 - 1) Y and the lead time l before a micro-batch's chunks are released (t_a; t_a + t_s for
    PP), micro-batches follow each other every F = max(g, r2 Y) (g = X, or t_a for AASS), and

        D = max(r1 X, r1 r2 Y, l + L[, r1 t_a + t_s for AASS]),
        step = (T - 1) D + max(r1 X, l + L + (r1 - 1) F) + dense layers.
    """
    if order not in ORDERS or r1 < 1 or r2 < 1:
        _check(order, r1, r2)
    a, s = times.attention, times.shared
    X = a + s
    Y = max(times.a2e, times.expert, times.e2a)
    L = times.a2e + times.expert + times.e2a + (r2 - 1) * Y
    lead = X if order == "PP" else a
    gap = a if order == "AASS" else X
    F = max(gap, r2 * Y)
    D = max(r1 * X, r1 * r2 * Y, lead + L)
    if order == "AASS":
        D = max(D, r1 * a + s)
    total = 0.0
    if moe_layers:
        total = (moe_layers - 1) * D + max(r1 * X, lead + L + (r1 - 1) * F)
    total += dense_layers * r1 * (a + times.dense)
    if host is not None:
        total = max(total, _host_bound(times, r1, r2, moe_layers, dense_layers, host))
    return total


DISPATCHED = ("attention", "shared", "a2e", "expert", "e2a")  # the tasks that are executor programs


def dispatch_order(
    times: StageTimes, order: str, r1: int, r2: int, layers: Sequence[bool]
) -> tuple[tuple[str, int, int, int], ...]:
    """The executor's dispatch sequence of one step: (task, layer, micro-batch, chunk) of every
    attention, shared, a2e, expert and e2a task (chunk -1 on the attention side), sorted by start
    time in the event model (``simulate``), ties in the model's own order (layer, then the attention
    group's sequence, then the chunks). A dense layer's MLP is part of its attention program (no
    entry); every MoE layer has a shared entry (the executor skips it where a layer has no shared
    experts). Stage times of 0 count as a millionth of the largest, so every task follows the tasks
    it needs: the sequence is a valid order to dispatch in."""
    _check(order, r1, r2)
    vals = dataclasses.astuple(times)
    floor = 1e-6 * max(max(vals), 1e-12)
    positive = StageTimes(*(max(v, floor) for v in vals))
    _, events = simulate(positive, order, r1, r2, layers, timeline=True)
    ranked = sorted(range(len(events)), key=lambda n: (events[n].start, n))
    return tuple((e.task, e.layer, e.micro_batch, e.chunk) for e in (events[n] for n in ranked) if e.task in DISPATCHED)


def _check(order: str, r1: int, r2: int) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    for name, v in (("r1", r1), ("r2", r2)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
