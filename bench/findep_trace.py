"""Measured per-stream timelines of a disaggregated step (for bench/findep.py's timeline plot).

``StreamTracer`` is the executor's ``observer``: it is called right after each phase is dispatched
(nothing blocks), notes the dispatch time and hands the phase's outputs to one watcher thread per
stream, which waits for them in dispatch order (each stream runs its tasks in order) and notes when
they are ready. A task's measured interval is [max(dispatch, end of the stream's previous task),
ready]: its start is an upper bound of when the device began (it may also have waited for inputs).
"""

from __future__ import annotations

import queue
import threading
import time

import jax

STREAM_OF = {  # executor phase -> stream (FinDEP Fig. 3/4 rows)
    "attention": "attention",
    "split": "attention",
    "shared": "shared",
    "a2e": "a2e",
    "expert": "expert",
    "e2a": "e2a",
    "join": "e2a",
}
STREAMS = ("attention", "shared", "a2e", "expert", "e2a")


class StreamTracer:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.tasks: list[dict] = []
        self._queues = {s: queue.Queue() for s in STREAMS}
        self._threads = [threading.Thread(target=self._watch, args=(s,), daemon=True) for s in STREAMS]
        for t in self._threads:
            t.start()

    def __call__(self, phase: str, layer, out) -> None:
        stream = STREAM_OF.get(phase)
        if stream is not None and layer is not None:
            # the first output only: later ones (the attention layer's KV cache) may be donated meanwhile
            self._queues[stream].put((phase, layer, time.perf_counter(), jax.tree.leaves(out)[0]))

    def _watch(self, stream: str) -> None:
        last = 0.0
        while True:
            item = self._queues[stream].get()
            if item is None:
                return
            phase, layer, dispatched, out = item
            jax.block_until_ready(out)
            ready = time.perf_counter()
            start = max(dispatched, last)
            last = ready
            self.tasks.append(
                {"stream": stream, "phase": phase, "layer": layer, "start": start - self.t0, "end": ready - self.t0}
            )

    def close(self) -> list[dict]:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=60)
        return sorted(self.tasks, key=lambda t: t["start"])


def plot_timelines(predicted: list[dict], measured: list[dict], path, title: str) -> None:
    """Two panels (predicted, measured), one row per stream, one bar per task (ms from the layer's
    start), coloured by micro-batch; the legend (which colour is which micro-batch) sits to the right."""
    from matplotlib.patches import Patch

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True)
    colors = plt.get_cmap("tab10")
    batches = set()
    for ax, tasks, name in ((axes[0], predicted, "predicted (event model)"), (axes[1], measured, "measured")):
        for row, stream in enumerate(STREAMS):
            for k, t in enumerate(x for x in tasks if x["stream"] == stream):
                batches.add(t.get("micro_batch", k) % 10)
                ax.broken_barh(
                    [(t["start"] * 1e3, max(1e-3, (t["end"] - t["start"]) * 1e3))],
                    (row - 0.4, 0.8),
                    color=colors(t.get("micro_batch", k) % 10),
                    edgecolor="black",
                    linewidth=0.4,
                )
        ax.set_yticks(range(len(STREAMS)), STREAMS)
        ax.invert_yaxis()
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("stream")
    axes[1].set_xlabel("time since the layer's first task (ms)")
    handles = [Patch(color=colors(b), label=f"micro-batch {b}") for b in sorted(batches)]
    axes[0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
