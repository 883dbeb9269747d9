"""Multi-host serving: every process runs the same engine steps, process 0 decides what they are.

Under ``jax.distributed`` the model spans processes, so every process must launch the same programs
(the same collectives) in the same order. Only process 0 (the *leader*) takes requests; its
``AsyncEngine`` records what changes its engine between steps (requests admitted and aborted) in a
journal, and before each step, and before each call that runs programs (warm-up, a live rescale),
sends the journal and the step (or call) to the other processes (*followers*) through JAX:
``multihost_utils.broadcast_one_to_all`` of a fixed-size byte buffer (a journal longer than the
buffer follows in a second broadcast, its size rounded up to a power of two so that few programs
compile). A follower (``follow``) applies each journal to its own ``LLMEngine`` in order, then the
step or the call; its outputs are dropped (the leader's front ends answer). Each process runs its own
scheduler on the same input, and the scheduler is deterministic; as a check, every journal starts
with the requests process 0's previous step ran (``CHECK``), and a follower whose step ran others
stops with ``ClusterFailedError`` (engines diverged) instead of launching mismatched collectives.

When the leader is idle it sends an empty journal every ``AsyncEngine`` idle poll (a heartbeat), so a
dead follower is noticed within a second: the broadcast (or the step's collectives) fails and the
leader's engine loop fails every request with ``ClusterFailedError``. ``STOP`` ends the followers.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any, Callable

import numpy as np

from jaxmoe.engine.request_stream import EngineStepError

log = logging.getLogger(__name__)

ADD, ABORT, STEP, CALL, STOP, CHECK = "add", "abort", "step", "call", "stop", "check"
HEADER_BYTES = 4096  # one broadcast carries a journal of up to HEADER_BYTES - 8 bytes (most steps)


class ClusterFailedError(EngineStepError):
    """A process of the cluster is gone (or diverged): the leader cannot run another step; the
    requests in flight end with it."""


def _broadcast(buf: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(buf))


class StepChannel:
    """Process 0 -> every process: a list of picklable operations, through ``broadcast_one_to_all``."""

    def __init__(self, broadcast: Callable[[np.ndarray], np.ndarray] = _broadcast):
        self._broadcast = broadcast
        self.broadcasts = 0
        self.bytes_sent = 0

    def send(self, ops: list) -> None:
        payload = np.frombuffer(pickle.dumps(ops, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        n = len(payload)
        head = np.zeros(HEADER_BYTES, np.uint8)
        head[:8] = np.frombuffer(np.int64(n).tobytes(), np.uint8)
        first = min(n, HEADER_BYTES - 8)
        head[8 : 8 + first] = payload[:first]
        self._broadcast(head)
        self.broadcasts += 1
        if n > first:
            rest = np.zeros(_pow2(n - first), np.uint8)
            rest[: n - first] = payload[first:]
            self._broadcast(rest)
            self.broadcasts += 1
        self.bytes_sent += n

    def receive(self) -> list:
        head = self._broadcast(np.zeros(HEADER_BYTES, np.uint8))
        n = int(np.frombuffer(head[:8].tobytes(), np.int64)[0])
        first = min(n, HEADER_BYTES - 8)
        data = head[8 : 8 + first].tobytes()
        if n > first:
            rest = self._broadcast(np.zeros(_pow2(n - first), np.uint8))
            data += rest[: n - first].tobytes()
        return pickle.loads(data)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class Leader:
    """Process 0's side: the journal of engine changes since the last broadcast."""

    def __init__(self, channel: StepChannel | None = None):
        self.channel = channel or StepChannel()
        self.pending: list[tuple] = []
        self.last_step: list[str] | None = None  # the request ids of the step run since the last sync
        self.failed: str | None = None  # why the cluster stopped (None: serving)
        self.stopped = False

    def added(self, engine, request_id: str) -> None:
        """Record a request the leader's engine admitted (its token ids, sampling and seed)."""
        state = engine._requests[request_id]
        seq = state.seq
        self.pending.append(
            (ADD, request_id, list(seq.prompt_ids), state.sampling, seq.priority.value, seq.cache_salt, state.seed)
        )

    def stepped(self, request_ids: list[str]) -> None:
        self.last_step = list(request_ids)

    def aborted(self, request_id: str) -> None:
        self.pending.append((ABORT, request_id))

    def sync(self, *ops: tuple) -> None:
        """Send the journal and ``ops`` to the followers (before running the ops here). Raises
        ``ClusterFailedError`` when a process is gone."""
        if self.failed is not None:
            raise ClusterFailedError(self.failed)
        check = [(CHECK, self.last_step)] if self.last_step is not None else []
        journal, self.pending, self.last_step = check + self.pending + list(ops), [], None
        try:
            self.channel.send(journal)
        except Exception as e:  # noqa: BLE001 - whatever the collective raises, the cluster is broken
            self.fail(f"a process of the cluster is gone: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            raise ClusterFailedError(self.failed) from None

    def fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
            log.error("multi-host serving stopped: %s", reason)

    def stop(self) -> None:
        """Tell the followers to exit (once; not after a failure)."""
        if self.failed is None and not self.stopped:
            self.stopped = True
            try:
                self.sync((STOP,))
            except ClusterFailedError:
                pass


def follow(engine, channel: StepChannel | None = None, on_step: Callable[[list], Any] | None = None) -> int:
    """A follower's loop: apply process 0's journals to ``engine`` until ``STOP``. Returns 0 after
    ``STOP``; raises when the leader is gone (the broadcast fails) or the engines diverged."""
    channel = channel or StepChannel()
    while True:
        for op in channel.receive():
            kind = op[0]
            if kind == ADD:
                _, rid, prompt_ids, sampling, priority, cache_salt, seed = op
                engine.add_request(prompt_ids, sampling, priority, rid, cache_salt=cache_salt)
                engine._requests[rid].seed = seed  # the seed process 0 drew (unseeded requests)
            elif kind == ABORT:
                engine.abort(op[1])
            elif kind == STEP:
                engine.step_request_ids = []  # as process 0's AsyncEngine does before each step
                outputs = engine.step()
                if on_step is not None:
                    on_step(outputs)
            elif kind == CALL:
                try:  # the leader ran the same call; an error there is the same error here
                    op[1](engine)
                except Exception:  # noqa: BLE001
                    log.exception("replicated call failed (as on process 0)")
            elif kind == CHECK:
                if list(engine.step_request_ids) != op[1]:
                    raise ClusterFailedError(
                        f"engines diverged: this process's last step ran requests {list(engine.step_request_ids)}, "
                        f"process 0's ran {op[1]}"
                    )
            elif kind == STOP:
                return 0
