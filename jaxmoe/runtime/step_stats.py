"""What the disaggregated executor records about its steps: per-MoE-layer transfer counts
(``TransferStats``) and, in timing mode, per-phase wall times (``Phases``, which also feeds an
observer every phase's outputs)."""

from __future__ import annotations

import dataclasses
import time

import jax

from jaxmoe.runtime.transfer import TransferCounts


@dataclasses.dataclass
class LayerTransferStats:
    """Cumulative hops and bytes of one MoE layer's A2E and E2A (and how many steps ran)."""

    steps: int = 0
    a2e: TransferCounts = TransferCounts()
    e2a: TransferCounts = TransferCounts()
    strategy: str = ""  # of the last step

    def count(self, plan) -> None:
        """One step's transfers under ``plan`` (``transfer.plan_transfers``)."""
        self.steps += 1
        self.a2e = self.a2e + plan.counts("a2e")
        self.e2a = self.e2a + plan.counts("e2a")
        self.strategy = plan.strategy

    def summary(self) -> dict:
        """Steps run, A2E/E2A hops and bytes so far (cumulative, split intra/cross-node), hops per
        step, and the strategy of the last step."""
        return {
            "steps": self.steps,
            "strategy": self.strategy,
            "a2e": dataclasses.asdict(self.a2e),
            "e2a": dataclasses.asdict(self.e2a),
            "a2e_transfers": self.a2e.transfers,
            "e2a_transfers": self.e2a.transfers,
            "a2e_bytes": self.a2e.nbytes,
            "e2a_bytes": self.e2a.nbytes,
            "transfers_per_step": (self.a2e.transfers + self.e2a.transfers) / self.steps if self.steps else 0.0,
        }


class Phases:
    """Runs one phase of a step. In timing mode it blocks on the phase's outputs and records the
    wall time (per layer) and, under "host", the CPU time the calling thread spent in the call (its
    work to dispatch the phase's programs, not the devices' threads nor waiting for a core; per layer,
    every phase of it summed; "host_step": embed and head); an observer sees every phase's outputs. With ``record_dispatch`` every
    program's dispatch is noted in order in ``dispatched``: (phase, layer, micro-batch, chunk, host
    seconds when it was dispatched, when the call returned); micro-batch and chunk from ``at``
    (None where not given)."""

    def __init__(self, timing: bool, observer, record_dispatch: bool = False):
        self.timing, self.observer = timing, observer
        self.dispatched: list[tuple] | None = [] if record_dispatch else None
        self.record: dict = {
            "embed": 0.0,
            "attention": {},
            "a2e": {},
            "expert": {},
            "shared": {},
            "e2a": {},
            "split": {},  # expert-side chunks (r2 > 1): cutting a micro-batch, joining the E2A outputs
            "join": {},
            "head": 0.0,
            "host": {},
            "host_step": 0.0,
        }

    def __call__(self, phase: str, layer, fn, *args, at: tuple | None = None):
        cpu0 = time.thread_time() if self.timing else 0.0  # the host's share: only where timed
        t0 = time.perf_counter()
        out = fn(*args)
        if self.dispatched is not None:
            self.dispatched.append((phase, layer, *(at or (None, None)), t0, time.perf_counter()))
        if self.timing:
            host = time.thread_time() - cpu0
            out = jax.block_until_ready(out)
            dt = time.perf_counter() - t0
            if layer is None:  # times of every micro-batch add up
                self.record[phase] += dt
                self.record["host_step"] += host
            else:
                self.record[phase][layer] = self.record[phase].get(layer, 0.0) + dt
                self.record["host"][layer] = self.record["host"].get(layer, 0.0) + host
        if self.observer is not None:
            self.observer(phase, layer, out)
        return out
