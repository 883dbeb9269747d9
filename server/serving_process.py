"""``SERVING``: the interpreter settings while a server of this process runs (the GIL switch
interval; the long-lived objects out of the garbage collector's reach; full collections rarer), shared by every server
of the process and undone when the last one stops."""

from __future__ import annotations

import gc
import sys
import threading

SWITCH_INTERVAL_S: float | None = 0.001  # the GIL switch interval while serving (at most; None: left as it is)
# young (generation-1) collections between two full ones while serving (at least; Python's default: 10)
FULL_COLLECTION_EVERY: int | None = 100


class ServingProcess:
    """The interpreter settings while at least one server of this process runs: the GIL switch
    interval lowered (restored when the last one stops) and the objects alive once each has warmed
    up frozen (``gc.freeze``; given back to the collector when the last one stops)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._running = 0
        self._interval: float | None = None  # the interval before the first server lowered it
        self._thresholds: tuple[int, int, int] | None = None  # the collector's, before the first server

    def begin(self) -> None:
        with self._lock:
            self._running += 1
            if self._running == 1 and SWITCH_INTERVAL_S is not None and sys.getswitchinterval() > SWITCH_INTERVAL_S:
                self._interval = sys.getswitchinterval()
                sys.setswitchinterval(SWITCH_INTERVAL_S)
            if self._running == 1 and FULL_COLLECTION_EVERY is not None:
                self._thresholds = gc.get_threshold()
                t0, t1, t2 = self._thresholds
                gc.set_threshold(t0, t1, max(t2, FULL_COLLECTION_EVERY))

    def freeze(self) -> None:
        with self._lock:
            gc.collect()  # no garbage is frozen with them
            gc.freeze()

    def refreeze(self) -> None:
        """After the served layout changed (live rescale, united experts): the objects of the old
        one, frozen, would never be collected if they hold a reference cycle; thaw, collect,
        freeze again (while a server runs)."""
        with self._lock:
            if self._running:
                gc.unfreeze()
                gc.collect()
                gc.freeze()

    def end(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                gc.unfreeze()
                if self._interval is not None:
                    sys.setswitchinterval(self._interval)
                    self._interval = None
                if self._thresholds is not None:
                    gc.set_threshold(*self._thresholds)
                    self._thresholds = None


SERVING = ServingProcess()
