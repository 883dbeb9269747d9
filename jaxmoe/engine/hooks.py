"""How features plug into the step loop: the declared seams of ``LLMEngine``.

* ``StepHook``: called before and after every step with the engine seen through ``EngineView``.
  Live re-scaling and the expert placement controller (``jaxmoe.janus``), SALC
  (``jaxmoe.brownout``) and the autoscaler (``jaxmoe.janus.scaling``) are step hooks.
* ``LayerHook``: called between the layers of a step that may pause (QLLM's layer-level
  preemption, ``jaxmoe.qllm``); one per engine.
* ``ReportsStats``: a hook whose state the serving loop publishes for metrics (``EngineStats``).

The engine calls hooks only through these methods; a hook reaches the engine only through the view.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from jaxmoe.engine.outputs import RequestOutput


class EngineView(Protocol):
    """The part of ``LLMEngine`` a hook may use."""

    config: Any  # EngineConfig
    scheduler: Any  # Scheduler: sequences(), get(), running, num_admitted, stats()
    step_request_ids: list[str]  # the requests of the step that just ran (or runs)
    last_step_ran: bool  # the latest step ran the model

    @property
    def executor(self) -> Any:
        """The executor serving now (``swap_executor`` replaces it)."""
        ...

    @property
    def runner(self) -> Any:
        """The ``ModelRunner`` over ``executor``: its shape plan and the program calls of the last step."""
        ...

    def swap_executor(self, runner, move_kv: Callable[[Any, Any, list], None]) -> list[str]:
        """Serve from ``runner.executor`` from the next step on (between steps only)."""
        ...

    def run_batch(self, batch, between_layers=None) -> list[RequestOutput]:
        """Run a scheduled batch through the model (another batch may be paused meanwhile)."""
        ...

    def merge_batch(self, batch, accept=None) -> Any:
        """Join a scheduled batch to the step paused at a pause point: a ``model_runner.Merge``, MERGED,
        DECLINED (``accept(merged shape, own shape)``, the caller's say on the merged call's padded
        [rows, tokens], said no) or UNAVAILABLE (it cannot join there)."""
        ...

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs made inside a step (by a batch run while another was paused) to their streams."""
        ...


@runtime_checkable
class StepHook(Protocol):
    def before_step(self, engine: EngineView) -> None:
        """Between steps, before the next one is scheduled."""
        ...

    def after_step(self, engine: EngineView, outputs: list[RequestOutput]) -> None:
        """After a step (``engine.last_step_ran`` says whether it ran the model) and its outputs."""
        ...


@runtime_checkable
class LayerHook(Protocol):
    """Optional besides: ``pauses_steps`` (False: no step pauses, steps run fused; default True) and
    ``choose_granularity(engine, shapes)``, which warm-up calls first (it may measure the shapes' steps
    and set the executor's ``pause_every`` or ``pauses_steps``)."""

    def pausable(self, engine: EngineView, batch) -> bool:
        """Whether this scheduled batch runs layer by layer with pause points."""
        ...

    def between_layers(self, engine: EngineView, layer: int) -> None:
        """At a pause point of a pausable step (``layer``: layers done); may run another batch."""
        ...


@runtime_checkable
class ReportsStats(Protocol):
    stats_key: str  # where ``EngineStats.snapshot`` puts ``stats()``

    def stats(self) -> dict:
        """A JSON-able snapshot of the hook's state (read on the engine's thread)."""
        ...
