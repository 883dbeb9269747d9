"""Live re-scaling of a running engine: another number of attention and expert instances without a
restart (JANUS 3.4 resource scaling), for the disaggregated executor. ``LiveRescaler`` is a step hook
(``jaxmoe.engine.hooks``) that the assembly attaches to every disaggregated engine.

``LiveRescaler.of(engine).start(attention=N, experts=M)`` checks the request at once (``RescaleError``
naming the value; nothing changes) and returns a ``RescaleJob``. Then:

1. **Build, in the background** (a thread; the old executor keeps serving): the new executor on the
   new layout (``runtime.rescale.build_rescaled``: attention parameters copied to the new attention
   devices; expert replicas kept on the devices that already hold them, only the others copied),
   and the step programs the new layout needs to serve the live requests now compiled by running
   them on padding rows (no KV written): ``ShapePlan.shapes_for`` the sequences live when the
   rescale starts (``full_warmup=True``: every warm-up shape). A shape met later compiles when
   first met, on the engine's thread (a one-time stall), as any jitted program. The thread runs at niceness ``BUILD_NICE`` and the GIL
   switch interval is ``BUILD_SWITCH_INTERVAL_S`` meanwhile, so the serving steps wait less for the
   host cores and the GIL.
2. **Swap, at a step boundary** (``before_step``, on the engine's thread; ``apply`` when the engine
   is idle): ``engine.swap_executor`` gives the KV blocks of live sequences blocks in the new
   layout's allocator (a partition of their own) and their KV is copied there
   (``janus.reshard.move_kv``); a sequence that does not fit is recompute-preempted (its tokens
   kept: it re-prefills over prompt + generated tokens). The engine then serves the new layout.
3. **Measured**: the swap time plus the first step on the new layout against a normal step is the
   stall (``RescaleResult``); the normal step is the median of the recent steps before the rescale
   started that made the same program calls (tokens per row of each call, ``ModelRunner.last_calls``)
   as the first step -- a step with a prefill chunk takes several times a decode-only step without
   any rescale, so the first step is compared with its like (all recent steps when fewer than
   ``MIN_LIKE_STEPS`` were alike). The job is done when the new layout has served a step (at once
   when idle).

Under ``jax.distributed`` (one process per host; ``agreed``) every process must call ``start`` at
the same point of the same request stream, and the build is split in two:

* **between steps, on every process** (in ``paused_s``): the new executor with the parameters and
  expert replicas moved (``build_rescaled``: across processes that is ``slot_moves`` collectives,
  which must run at the same point everywhere);
* the new layout's step programs compiled without running them (``ModelRunner.lower_step``: lowered
  on the serving shapes; a program that ran would launch collectives), in one of three forms
  (``LiveRescaler.across_processes``):

  - ``"beside"`` (the default): every process lowers one serving shape's programs before each step
    (``apply`` lowers one when the engine is idle), on the engine's thread -- lowering may run a
    collective: ``jax.device_put`` of a host value onto a sharding spanning every process runs
    ``multihost_utils.assert_equal`` -- and hands them to ``compile_workers()`` background threads
    (niceness ``BUILD_NICE``) that only call ``Lowered.compile()``: local to the process, no
    collective, nothing runs. The engine keeps stepping meanwhile; a step waits for one lowering at
    most (``largest_pause_s``), never for a compile. The process is built once every lowering ran
    and every compile finished;
  - ``"steps"`` (cooperative): the compiles are cut into units too (lowering one serving shape's
    programs, then compiling them ``compile_workers()`` at a time, the engine's thread waiting) and
    every process runs the next unit before each step: a step waits for one compile;
  - ``"stop"``: all of them between the same two steps as the parameter moves (stop-the-world:
    ``paused_s`` includes it, ``build_s`` is its part), and the swap follows there at once.

Then the processes agree on the swap step: before every step (and in ``apply``) while a build is
in progress every process contributes its state (building, built, failed) to one all-gather
(``multihost_utils.process_allgather``, a collective at the same point of every process's step
sequence, so all see the same states); the swap happens on every process at the first step where
all report built, and a build failed anywhere fails the rescale everywhere (the old layout stays).
Either side may span processes when its instances are one device each
(``janus.reshard.check_processes``); the KV blocks of live sequences then move at the swap in a
collective every process runs at that step (``janus.reshard.move_kv``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import os
import statistics
import sys
import threading
import time
from typing import Callable

import jax
import numpy as np

from jaxmoe.compilation import compile_events

from jaxmoe.engine.model_runner import ModelRunner
from jaxmoe.engine.warmup import compile_workers
from jaxmoe.kv_layout import KVLayout
from jaxmoe.mesh import MeshConfigError
from jaxmoe.runtime.disaggregated import DisaggregatedExecutor
from jaxmoe.janus.program_caches import forget_cached_programs
from jaxmoe.janus.reshard import (
    MoveStats,
    build_rescaled,
    check_processes,
    lower_kv_move,
    move_kv,
    rescaled_spec,
)

MIN_LIKE_STEPS = 3  # recent steps with the first step's program calls needed to use them as its baseline
BUILD_NICE = 10  # the background build thread's niceness (Linux: per thread), below the serving loop
# while a background build runs, the interpreter's GIL switch interval (s; None: left as it is): the
# build traces in Python, and a step that waits for the GIL waits up to one interval each time
BUILD_SWITCH_INTERVAL_S: float | None = 0.0005
BUILDING, BUILT, FAILED = 0, 1, 2  # a process's build state in the agreement (``LiveRescaler.gather``)
# ``LiveRescaler.across_processes``' default: how an agreed build compiles ("beside": lowered before
# the steps, compiled in background threads beside them; "steps": lowered and compiled in units before
# the steps; "stop": all between two steps)
ACROSS_PROCESSES = "beside"
BUILD_FORMS = ("beside", "steps", "stop")


class RescaleError(ValueError):
    """A rescale that cannot be done (names the value); nothing was changed."""


class RescaleCancelledError(RescaleError):
    """The build was cancelled (the server is shutting down): the old layout stays."""


class RescaleInProgressError(RescaleError):
    """A rescale arrived while another one is being built or swapped in."""


@dataclasses.dataclass
class RescaleResult:
    attention: int  # instances now
    experts: int
    slots_per_instance: int
    previous: str  # e.g. "2a6e"
    build_s: float  # background: new executor + expert re-shard + compiling the step programs
    swap_s: float  # at the step boundary: KV blocks moved, executor swapped
    first_step_s: float | None  # the first step on the new layout (None: the engine was idle)
    # median of the recent steps before the rescale started with the first step's program calls (all
    # recent steps when fewer than MIN_LIKE_STEPS were alike; None: none ran)
    normal_step_s: float | None
    stall_ratio: float | None  # (largest_pause_s + swap_s + first_step_s) / normal_step_s
    kv_blocks_moved: int
    sequences_recomputed: int
    expert_slots_local: int  # new slots whose expert the instance (its devices) already held (no copy)
    expert_slots_copied: int  # copied from another device
    expert_bytes_copied: int
    # under jax.distributed: the part of the build run between steps on every process (parameters and
    # replicas moved); 0 in one process, where all of the build runs beside the steps
    paused_s: float = 0.0
    steps_during_build: int = 0  # steps the old layout served after the start, before the swap
    # programs compiled (or loaded from the persistent cache) by this process during the first step on
    # the new layout (None: the engine was idle): what the build did not compile ahead
    first_step_compiles: int | None = None
    # (rows, tokens per row) of each program call of the first step on the new layout ([]: idle)
    first_step_calls: list = dataclasses.field(default_factory=list)
    shapes_compiled: int = 0  # step shapes the build compiled (the rest compile when first met)
    # under jax.distributed: the longest single pause of the serving for the build (the parameter
    # moves, or one build unit between two steps: the longest unit any process ran there, as the
    # step waits for the slowest; or the whole build when it stops the world)
    largest_pause_s: float = 0.0
    build_units: int = 0  # "steps": the build units run between steps (lowerings and compiles)
    # "beside" / "steps": [unit, seconds] of each unit run between two steps, in order (unit: "lower
    # RxT" or ("steps") "compile RxT: programs", the serving shape: rows per instance x tokens per row;
    # "lower kv move" / "compile kv move: ...": the swap's KV-move programs)
    unit_pauses_s: list = dataclasses.field(default_factory=list)
    # "beside": [program, seconds] of each program compiled by the background threads while the old
    # layout served (the shape's or "kv move", and the program's name)
    compiled_beside_s: list = dataclasses.field(default_factory=list)
    # "steps": per step during the build, the longest unit any process ran before it (s; every process
    # reports its unit in the agreement): the pause the serving saw there
    step_pauses_s: list = dataclasses.field(default_factory=list)
    # KV bytes of the moved blocks that changed device at the swap (every layer; across processes they
    # travel in ``slot_moves`` ppermute rounds)
    kv_bytes_moved: int = 0
    # programs compiled (or loaded from the persistent cache) by this process during the swap (the KV
    # move's are compiled ahead with the step programs; None: not counted)
    swap_compiles: int | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class RescaleJob:
    """One rescale: ``ready()`` once built and compiled, ``result(timeout)`` once the new layout serves
    (raises the build's or the swap's error: the old layout then keeps serving)."""

    def __init__(self, attention: int, experts: int, slots: int):
        self.attention, self.experts, self.slots_per_instance = attention, experts, slots
        self._ready, self._done = threading.Event(), threading.Event()
        self._result: RescaleResult | None = None
        self._error: BaseException | None = None
        self.executor = self.runner = None
        self.stats = MoveStats()
        self.build_s = 0.0
        self.swap_s: float | None = None
        self.recomputed = 0
        self.before: list[tuple[float, tuple]] = []  # (time, tokens per row of each call) of recent steps
        self.previous = ""
        self.agreed = False  # jax.distributed: built on every process, swapped where all report built
        self.paused_s = 0.0  # agreed: the part of the build run between steps
        self.steps_during_build = 0
        self.build_error: RescaleError | None = None  # agreed: this process's build failed (not yet agreed)
        self.compiles_at_swap: int | None = None
        self.swap_compiles: int | None = None  # programs compiled during the swap
        self.old_executor = None  # agreed: the executor the KV moves from at the swap (its programs compile ahead)
        self.thread: threading.Thread | None = None  # the background build
        self.cancelled = False  # Rescaler.cancel(): the build stops before its next compile
        self.shapes: list[tuple[int, int]] = []  # (rows per instance, tokens per row) the build compiles
        self.units = None  # agreed "steps": the build's units not run yet (a generator; None: none left)
        self.units_run = 0
        self.unit_pauses: list[list] = []  # [unit, seconds] of each unit run
        self.idle_units = 0  # of them, run by ``apply`` (the engine idle)
        self.largest_pause_s = 0.0  # agreed: the longest single pause between two steps for the build
        self.last_unit_s = 0.0  # agreed "steps": this process's unit since the last agreement (s)
        self.step_pauses: list[float] = []  # per agreement with a unit run: the slowest process's unit (s)
        # agreed "beside": the background compiles (futures of [program, seconds]; None: another form)
        self.compiles: list[concurrent.futures.Future] | None = None
        self.compile_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.build_t0 = 0.0  # agreed "beside": when the build (after the parameter moves) began

    @property
    def target(self) -> str:
        return f"{self.attention}a{self.experts}e"

    def ready(self) -> bool:
        """Built in this process (agreed: the swap waits for every process)."""
        return self._ready.is_set()

    @property
    def swapped(self) -> bool:
        return self.swap_s is not None

    def done(self) -> bool:
        return self._done.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def result(self, timeout: float | None = None) -> RescaleResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"rescale to {self.target} not done after {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()
        self._done.set()


class LiveRescaler:
    """The engine's live re-scaling (one at a time): ``start`` a rescale, ``apply`` it when idle; a
    step hook swaps it in at the next step boundary and measures the stall."""

    def __init__(self, engine, executor_kwargs: dict | None = None):
        """``executor_kwargs``: what the new executors are built with too (replica_policy, aebs_impl,
        interpret)."""
        self.engine = engine
        self.executor_kwargs: dict = dict(executor_kwargs or {})
        ex = engine.executor
        # expert slots a device's memory holds: the launch layout's mesh-file C (CPU devices report no memory
        # limit; with brownout the united experts' ceil(U / N) slots per instance come on top)
        self.max_slots_per_instance = (
            ex.sub.spec.experts.slots_per_instance if isinstance(ex, DisaggregatedExecutor) else None
        )
        self.job: RescaleJob | None = None
        self.history: list[RescaleResult] = []
        self._step_times: collections.deque[tuple[float, tuple]] = collections.deque(maxlen=64)
        self._lock = threading.Lock()
        self._t0 = 0.0
        # several processes (jax.distributed): build on each, swap at the step all agree on
        self.agreed = jax.process_count() > 1
        # every process's (build state: BUILDING / BUILT / FAILED, its unit's microseconds) from this
        # process's, rows in process order; a collective
        self.gather: Callable[[np.ndarray], np.ndarray] = _allgather
        # agreed: how the programs compile (BUILD_FORMS): lowered before each step and compiled in
        # background threads ("beside", the default), lowered and compiled in units before each step
        # ("steps"), or all between two steps ("stop")
        self.across_processes = ACROSS_PROCESSES

    @classmethod
    def attach(cls, engine, executor_kwargs: dict | None = None) -> "LiveRescaler":
        return engine.add_hook(cls(engine, executor_kwargs))

    @staticmethod
    def find(engine) -> "LiveRescaler | None":
        """The engine's rescaler (None: it has none, a monolithic engine)."""
        return next((hook for hook in engine.hooks if isinstance(hook, LiveRescaler)), None)

    @staticmethod
    def of(engine) -> "LiveRescaler":
        """The engine's rescaler; ``RescaleError`` when it has none (a monolithic engine)."""
        rescaler = LiveRescaler.find(engine)
        if rescaler is None:
            raise RescaleError("rescale needs the disaggregated executor (start the engine with a mesh file)")
        return rescaler

    # -- request ------------------------------------------------------------------------------
    def start(
        self, attention: int, experts: int, slots_per_instance: int | None = None, full_warmup: bool = False
    ) -> RescaleJob:
        """Start a rescale (on the engine's thread, between steps). The build compiles the shapes the
        live sequences need now (``full_warmup``: every shape warm-up compiles)."""
        ex = self.engine.executor
        if not isinstance(ex, DisaggregatedExecutor):
            raise RescaleError("rescale needs the disaggregated executor (start the engine with a mesh file)")
        error = None
        try:
            spec = self._checked_spec(ex, attention, experts, slots_per_instance)
        except RescaleError as e:
            error = e
        if self.agreed:  # before any collective move: every process starts, or none does
            error = self._agree_on_start(error, f"attention={attention}, experts={experts}")
        if error is not None:
            raise error
        C = spec.experts.slots_per_instance
        with self._lock:
            if self.job is not None:
                raise RescaleInProgressError(
                    f"a rescale to {self.job.target} is in progress; attention={attention}, experts={experts} "
                    "was not started (retry when it is done)"
                )
            job = self.job = RescaleJob(attention, experts, C)
        job.previous = f"{ex.num_attention}a{ex.num_expert_instances}e"
        return self._start(job, ex, spec, full_warmup)

    def _checked_spec(self, ex, attention: int, experts: int, slots_per_instance: int | None):
        """The new layout's cluster spec; ``RescaleError`` naming the value that does not fit."""
        try:
            spec = rescaled_spec(ex.sub.spec, attention, experts, slots_per_instance)
            check_processes(ex.sub, spec, ex.expert_side.num_extra > 0)
        except MeshConfigError as e:
            raise RescaleError(str(e)) from None
        C, E = spec.experts.slots_per_instance, ex.cfg.moe.num_experts
        limit = self.max_slots_per_instance
        if limit is not None and C > limit:
            raise RescaleError(f"slots_per_instance={C}: a device's memory holds {limit} expert slots")
        if experts * C < E:
            raise RescaleError(
                f"experts={experts}: {E} experts need {math.ceil(E / experts)} slots per instance, "
                f"memory holds {C} (experts x slots_per_instance = {experts * C} < {E})"
            )
        if (attention, experts, C) == (
            ex.num_attention,
            ex.num_expert_instances,
            ex.sub.spec.experts.slots_per_instance,
        ):
            raise RescaleError(f"the engine already runs {attention}a{experts}e with {C} slots per instance")
        self._check_fits(self._kv_layout(attention))
        if self.agreed and self.across_processes not in BUILD_FORMS:
            raise RescaleError(f"across_processes={self.across_processes!r}: one of {', '.join(BUILD_FORMS)}")
        return spec

    def _agree_on_start(self, error: RescaleError | None, request: str) -> RescaleError | None:
        """(agreed; every process at the same point) Whether every process accepted the request (one
        all-gather): this process's error, or one naming the processes that refused it, or None."""
        gathered = np.reshape(self.gather(np.array([FAILED if error else BUILDING, 0], np.int32)), (-1, 2))
        refused = [p for p, state in enumerate(gathered[:, 0]) if int(state) == FAILED]
        if error is None and refused:
            error = RescaleError(f"{request}: refused on process {', '.join(map(str, refused))}; nothing changed")
        return error

    def _start(self, job: RescaleJob, ex, spec, full_warmup: bool) -> RescaleJob:
        plan = self.engine.runner.plan
        # one process: only the shapes the live requests need now (the rest compile when first met);
        # across processes every shape, compiled ahead while the world stops anyway
        every = full_warmup or self.agreed
        job.shapes = plan.shapes() if every else plan.shapes_for(self.engine.scheduler.sequences())
        # the baseline: steps before the build (those during it compete with it for the host)
        job.before = list(self._step_times)
        if self.agreed:
            # multi-controller: every process must launch the same collectives in the same order, so
            # what moves data runs here, between steps; the compiles (no collective) as the form says
            job.agreed = True
            job.old_executor = ex
            form = self.across_processes
            self._move_parameters(job, ex, spec)
            job.largest_pause_s = job.paused_s
            if job.build_error is not None:  # every process learns it at the next agreement
                return job
            if form == "beside":  # lowered before each step, compiled beside the steps
                job.compiles, job.build_t0 = [], time.perf_counter()
                job.compile_pool = concurrent.futures.ThreadPoolExecutor(
                    compile_workers(), thread_name_prefix="jaxmoe-rescale-compile", initializer=_lower_thread_priority
                )
                job.units = self._lowering_units(job)
                return job
            if form == "steps":  # one unit before each step (``_build_unit``), the same on every process
                job.units = self._build_units(job)
                return job
            if form == "stop":  # compiled here too, then swapped at once
                t0 = time.perf_counter()
                try:
                    self._compile_ahead(job)
                except Exception as e:  # every process learns it at the agreement just below
                    job.build_error = RescaleError(f"building the {job.target} layout failed: {type(e).__name__}: {e}")
                job.build_s = time.perf_counter() - t0
                job.paused_s += job.build_s
                job.largest_pause_s = job.paused_s
                job._ready.set()
                self._settle(job)  # every process waits here for the slowest (a call, not a step)
                if job.swap_s is not None and not self.engine.has_work():
                    self._finish(job, None)
                return job
        job.thread = threading.Thread(target=self._build, args=(job, ex, spec), name="jaxmoe-rescale", daemon=True)
        job.thread.start()
        return job

    def _move_parameters(self, job: RescaleJob, old, spec) -> None:
        """(agreed) The new executor and its runner, parameters and replicas moved: between steps, on
        every process at the same point. A failure is this process's build state (every process drops
        the rescale at the next agreement; nothing changed)."""
        t0 = time.perf_counter()
        try:
            cfg = self.engine.config
            job.executor, job.stats = build_rescaled(old, spec, cfg.num_blocks * cfg.block_size, **self.executor_kwargs)
            runner = self.engine.runner
            job.runner = ModelRunner(job.executor, runner.block_size, runner.max_blocks_per_seq, runner.plan)
            jax.block_until_ready((job.executor.params, job.executor.cache))  # every copy landed
        except Exception as e:
            job.build_error = RescaleError(f"building the {job.target} layout failed: {type(e).__name__}: {e}")
            job._ready.set()
        job.paused_s = time.perf_counter() - t0

    @staticmethod
    def _build_units(job: RescaleJob):
        """(agreed, "steps") The compiles as units, one per ``next()``: lowering one serving shape's
        step programs (``ModelRunner.lower_step``), then compiling them ``compile_workers()`` at a
        time, one program per thread, the engine's thread waiting (nothing runs). The units depend
        only on the layout, the shapes and the worker count, so processes with as many cores run
        the same list (others only finish at another step: the agreement waits for the last)."""
        workers = compile_workers()
        pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxmoe-rescale-compile")
        try:
            lowerings = [
                (f"{rows}x{tokens}", functools.partial(job.runner.lower_step, rows, tokens))
                for rows, tokens in job.shapes
            ]
            lowerings.append(("kv move", lambda: _lower_kv_move(job)))  # the swap's KV move (fixed rounds)
            for name, lower in lowerings:
                programs = lower() or []  # None: compiles on first use
                yield f"lower {name}"
                for i in range(0, len(programs), workers):  # each fills the cache the step looks in
                    chunk = programs[i : i + workers]
                    list(pool.map(lambda program: program.compile(), chunk))
                    yield f"compile {name}: {', '.join(_program_name(p) for p in chunk)}"
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    def _lowering_units(job: RescaleJob):
        """(agreed, "beside") One serving shape's step programs lowered per ``next()`` (then the swap's
        KV move), on the engine's thread; once all are lowered they go to the background compile
        threads, which only compile them (local to this process: no collective, nothing runs; started
        after the lowerings, which they would slow down). Every process lowers every shape, so all run
        the same units at the same steps."""
        lowerings = [
            (f"{rows}x{tokens}", functools.partial(job.runner.lower_step, rows, tokens)) for rows, tokens in job.shapes
        ]
        lowerings.append(("kv move", lambda: _lower_kv_move(job)))  # the swap's KV move (fixed rounds)
        lowered = []
        for name, lower in lowerings:
            lowered += [(name, program) for program in lower() or []]  # None: compiles on first use
            yield f"lower {name}"
        job.compiles += [job.compile_pool.submit(_compile, name, program) for name, program in lowered]

    def _build_unit(self, job: RescaleJob) -> bool:
        """(agreed, "beside" / "steps") Run the build's next unit here, between two steps (every process
        at the same point); past the last one the job is built ("beside": once the background compiles
        are done too). A failure is this process's build state (every process learns it at the
        agreement that follows). Returns whether a unit ran."""
        if job.ready():
            return False
        if job.units is None:
            self._check_compiled(job)
            return False
        t0 = time.perf_counter()
        try:
            unit = next(job.units)
            job.units_run += 1
            job.unit_pauses.append([unit, round(time.perf_counter() - t0, 4)])
        except StopIteration:
            job.units = None
            self._check_compiled(job)
        except Exception as e:
            self._build_failed(job, e)
        dt = time.perf_counter() - t0
        if job.compiles is None:  # "steps": the build is its units
            job.build_s += dt
        job.paused_s += dt
        job.last_unit_s = dt
        job.largest_pause_s = max(job.largest_pause_s, dt)
        return True

    def _check_compiled(self, job: RescaleJob) -> None:
        """(agreed) Every unit ran: built here once the background compiles ("beside") are done (the
        first compile error is the build's); never waits for them."""
        if job.compiles is not None:
            if not all(f.done() for f in job.compiles):
                return
            errors = [f.exception() for f in job.compiles if f.exception() is not None]
            if errors:
                self._build_failed(job, errors[0])
                return
            job.build_s = time.perf_counter() - job.build_t0
            _stop_compiles(job)
        job._ready.set()

    @staticmethod
    def _build_failed(job: RescaleJob, error: BaseException) -> None:
        job.units = None
        job.build_error = RescaleError(f"building the {job.target} layout failed: {type(error).__name__}: {error}")
        _stop_compiles(job)
        job._ready.set()

    def _kv_layout(self, attention: int) -> KVLayout:
        cfg = self.engine.config
        return KVLayout.for_slots(cfg.num_blocks * cfg.block_size, cfg.block_size, attention)

    def _check_fits(self, layout: KVLayout) -> None:
        """Every live request's longest context must fit one attention instance of ``layout``."""
        per = layout.slots_per_instance
        for seq in self.engine.scheduler.sequences():
            need = len(seq.prompt_ids) + (seq.max_tokens or 0)
            if need > per:
                raise RescaleError(
                    f"attention={layout.num_instances}: request {seq.request_id!r} may need {need} KV slots, "
                    f"one attention instance would hold {per}"
                )

    def _build(self, job: RescaleJob, old, spec) -> None:
        if BUILD_SWITCH_INTERVAL_S is None:
            self._build_now(job, old, spec)
            return
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, BUILD_SWITCH_INTERVAL_S))
        try:
            self._build_now(job, old, spec)
        finally:
            sys.setswitchinterval(interval)

    def _build_now(self, job: RescaleJob, old, spec) -> None:
        """(one process) The new layout built in the background thread: parameters copied, the step
        programs compiled by running them on padding rows."""
        t0 = time.perf_counter()
        _lower_thread_priority()
        try:
            cfg = self.engine.config
            job.executor, job.stats = build_rescaled(old, spec, cfg.num_blocks * cfg.block_size, **self.executor_kwargs)
            runner = self.engine.runner
            job.runner = ModelRunner(job.executor, runner.block_size, runner.max_blocks_per_seq, runner.plan)
            for rows, tokens in job.shapes:  # compile by running on padding rows (no KV)
                if job.cancelled:
                    return  # cancel() failed the job already
                job.runner.warm(rows, tokens)
                if self.engine.layer_hook is not None:
                    job.runner.warm(rows, tokens, layer_by_layer=True)
            jax.block_until_ready((job.executor.params, job.executor.cache))  # every copy landed
        except Exception as e:  # the old layout keeps serving
            with self._lock:
                self.job = None
            job._fail(RescaleError(f"building the {job.target} layout failed: {type(e).__name__}: {e}"))
            return
        job.build_s = time.perf_counter() - t0
        if not job.cancelled:
            job._ready.set()

    @staticmethod
    def _compile_ahead(job: RescaleJob) -> bool:
        """(agreed, "stop") Every step program of the serving shapes lowered here and compiled on
        ``compile_workers()`` threads (XLA compiles without the GIL; the threads inherit this one's
        niceness); nothing runs. False: cancelled (the compiles started finish first)."""
        pool = concurrent.futures.ThreadPoolExecutor(compile_workers(), thread_name_prefix="jaxmoe-rescale-compile")
        futures = []
        try:
            lowered = [job.runner.lower_step(rows, tokens) or [] for rows, tokens in job.shapes]
            for program in [p for programs in lowered for p in programs] + _lower_kv_move(job):
                if job.cancelled:  # (lower_step None: compiles on first use)
                    return False
                futures.append(pool.submit(program.compile))
            for future in futures:
                while not future.done():
                    if job.cancelled:
                        return False  # the compiles not started are dropped (shutdown below)
                    concurrent.futures.wait([future], timeout=0.2)
                future.result()  # the first compile error, if any
            return not job.cancelled
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    # -- at step boundaries (the engine's thread: a step hook) -------------------------------------
    def before_step(self, engine) -> None:
        """Swap in a built layout, then time the step."""
        job = self.job
        if job is not None and job.swap_s is None:
            if job.agreed:
                self._build_unit(job)
                self._settle(job)
            elif job.ready():
                self._swap(job)
        self._t0 = time.perf_counter()

    def _settle(self, job: RescaleJob) -> bool:
        """(agreed; every process at the same point) Gather every process's build state: all built,
        swap now (True); one failed, the job fails on every process (the old layout stays); else wait."""
        mine = BUILDING if not job.ready() else FAILED if job.build_error is not None else BUILT
        gathered = np.reshape(self.gather(np.array([mine, round(job.last_unit_s * 1e6)], np.int32)), (-1, 2))
        states = [int(v) for v in gathered[:, 0]]
        if gathered[:, 1].any():  # a unit ran before this step somewhere: the step waited for the slowest
            slowest = float(gathered[:, 1].max()) / 1e6
            job.step_pauses.append(slowest)
            job.largest_pause_s = max(job.largest_pause_s, slowest)
        job.last_unit_s = 0.0
        if FAILED in states:
            job.cancelled = True  # this process's build stops before its next shape
            job.units = None  # its units not run yet are dropped
            _stop_compiles(job)  # ("beside") and its compiles not started
            with self._lock:
                self.job = None
            others = [p for p, v in enumerate(states) if v == FAILED]
            job._fail(
                job.build_error
                or RescaleError(f"building the {job.target} layout failed on process {', '.join(map(str, others))}")
            )
            return False
        if all(v == BUILT for v in states):
            self._swap(job)
            return True
        return False

    def after_step(self, engine, outputs) -> None:
        dt = time.perf_counter() - self._t0
        if not engine.last_step_ran:
            return
        job, calls = self.job, list(engine.runner.last_calls)
        if job is not None and job.swap_s is not None and not job.done():
            self._finish(job, dt, calls)
        else:
            if job is not None and job.swap_s is None:
                job.steps_during_build += 1
            self._step_times.append((dt, tuple(t for _, t in calls)))

    def cancel(self) -> bool:
        """Cancel a build in flight (any thread; shutting down): its waiters get
        ``RescaleCancelledError`` at once, the build thread stops before its next compile, the old
        layout stays. A layout already built is left to its swap. Returns whether one was cancelled."""
        with self._lock:
            job = self.job
            # agreed: every process must drop it at the same step (the cluster stops anyway)
            if job is None or job.ready() or job.agreed:
                return False
            job.cancelled = True
            self.job = None
        job._fail(RescaleCancelledError(f"the rescale to {job.target} was cancelled: the server is shutting down"))
        return True

    def apply(self) -> bool:
        """Swap in a built layout now (between steps); when the engine is idle the job is done at once.
        Returns whether a swap happened. Agreed (``jax.distributed``; every process calls it at the
        same point): only once every process has built (``_settle``); False meanwhile. An idle
        engine's build advances here: one unit per call (none while requests run: the steps run them,
        one each)."""
        job = self.job
        if job is None:
            return False
        if job.swap_s is not None:  # swapped before a step that found nothing to run: done once idle
            if not job.done() and not self.engine.has_work():
                self._finish(job, None)
            return False
        if job.agreed:
            if not self.engine.has_work() and self._build_unit(job):
                job.idle_units += 1
            if not self._settle(job):
                return False
        elif not job.ready():
            return False
        else:
            self._swap(job)
        if job.swap_s is not None and not self.engine.has_work():
            self._finish(job, None)
        return True

    def _swap(self, job: RescaleJob) -> None:
        engine, t0 = self.engine, time.perf_counter()
        new = job.executor
        try:
            self._check_fits(new.kv_layout)  # requests admitted while it was built
        except RescaleError as e:
            with self._lock:
                self.job = None
            job._fail(e)
            return
        before = compile_events()["programs"]
        recomputed = engine.swap_executor(job.runner, lambda old, new, moves: move_kv(old, new, moves, job.stats))
        jax.block_until_ready(new.cache)
        job.swap_compiles = compile_events()["programs"] - before
        forget_cached_programs()  # the old layout's programs go with the old executor
        job.compiles_at_swap = compile_events()["programs"]
        job.swap_s = time.perf_counter() - t0
        job.recomputed = len(recomputed)
        job.executor = job.runner = job.old_executor = None

    def _finish(self, job: RescaleJob, first_step_s: float | None, calls: list | None = None) -> None:
        calls = calls or []
        normal = normal_step(job.before, calls)
        # the longest pause of an agreed build between two steps stopped serving too (0 in one process)
        paused = job.swap_s + job.largest_pause_s
        stall = None if first_step_s is None or not normal else (paused + first_step_s) / normal
        s = job.stats
        compiles = None
        if first_step_s is not None and job.compiles_at_swap is not None:
            compiles = compile_events()["programs"] - job.compiles_at_swap
        job._result = RescaleResult(
            job.attention,
            job.experts,
            job.slots_per_instance,
            job.previous,
            job.build_s,
            job.swap_s,
            first_step_s,
            normal,
            stall,
            s.kv_blocks_moved,
            job.recomputed,
            s.expert_slots_local,
            s.expert_slots_copied,
            s.expert_bytes_copied,
            paused_s=job.paused_s,
            steps_during_build=job.steps_during_build,
            first_step_compiles=compiles,
            first_step_calls=[list(c) for c in calls],
            shapes_compiled=len(job.shapes),
            largest_pause_s=job.largest_pause_s,
            build_units=job.units_run,
            unit_pauses_s=job.unit_pauses,
            compiled_beside_s=[f.result() for f in job.compiles or [] if f.done() and f.exception() is None],
            step_pauses_s=job.step_pauses,
            kv_bytes_moved=s.kv_bytes_moved,
            swap_compiles=job.swap_compiles,
        )
        self.history.append(job._result)
        self._step_times.clear()  # the new layout's steps are the next baseline
        with self._lock:
            self.job = None
        job._done.set()


def _program_name(program) -> str:
    """A lowered program's name (its module's, e.g. ``jit_layer_step``), for ``unit_pauses_s``."""
    lowered = getattr(program, "lowered", program)  # slot_moves.AheadProgram wraps one
    try:
        return str(lowered.compiler_ir().operation.attributes["sym_name"]).strip('"')
    except Exception:  # no MLIR module to read: the unit keeps its shape's name only
        return "program"


def _compile(name: str, program) -> list:
    """(a background compile thread) ``program`` compiled, which fills the cache the step looks in:
    local to this process, nothing runs. [its shape's name and program's, seconds]."""
    t0 = time.perf_counter()
    program.compile()
    return [f"{name}: {_program_name(program)}", round(time.perf_counter() - t0, 4)]


def _stop_compiles(job: RescaleJob) -> None:
    """(agreed "beside") The background compile threads end once their compile in flight is done;
    those not started are dropped. Never waits."""
    if job.compile_pool is not None:
        job.compile_pool.shutdown(wait=False, cancel_futures=True)
        job.compile_pool = None


def _lower_kv_move(job: RescaleJob) -> list:
    """(agreed) The KV-move programs of the swap from the serving executor to the new one, lowered
    (``janus.reshard.lower_kv_move``: empty when the KV moves through host memory)."""
    old = job.old_executor
    return [] if old is None else lower_kv_move(old, job.executor)


def normal_step(before: list[tuple[float, tuple]], calls: list) -> float | None:
    """The normal step to compare a first step with: the median time of the ``before`` steps ((time,
    tokens per row of each program call) pairs) that made the same program calls as ``calls`` ((rows,
    tokens per row) of each call of the first step; rows depend on the layout, tokens per row do not),
    or of all of them when fewer than ``MIN_LIKE_STEPS`` were alike; None when ``before`` is empty."""
    key = tuple(t for _, t in calls)
    like = [dt for dt, c in before if c == key]
    alike = like if len(like) >= MIN_LIKE_STEPS else [dt for dt, _ in before]
    return statistics.median(alike) if alike else None


def _allgather(mine: np.ndarray) -> np.ndarray:
    """Every process's ``mine`` (an int32 vector), one row per process in process order
    (``multihost_utils.process_allgather``: every process must call it at the same point)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(mine))


def _lower_thread_priority() -> None:
    """Run the calling (build) thread at ``BUILD_NICE`` so the serving loop's steps get the host cores
    first while it compiles (Linux sets niceness per thread; elsewhere a no-op)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BUILD_NICE)
    except (AttributeError, OSError):  # no per-thread niceness here: the build runs at the loop's priority
        pass
