"""Admin operations, independent of the web framework: each takes the ``AsyncEngine`` and a JSON-like
payload and returns a JSON-ready dict, raising ``AdminError`` (with the HTTP status and the gRPC
status to answer) on bad input. The front ends only translate: the gRPC ``Rescale`` RPC
(``grpc_service``) and HTTP ``POST /admin/rescale`` and ``POST /admin/united_experts``
(``http_service``).

``rescale`` blocks until the new layout serves, ``load_united_experts`` until the engine thread has
swapped the united experts between two steps (run both in a worker thread from async code).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import grpc
import pydantic

from jaxmoe.janus.live_rescale import LiveRescaler, RescaleCancelledError, RescaleError, RescaleInProgressError
from jaxmoe.server.serving_process import SERVING

APPLY_POLL_S = 0.25  # across processes: how often a built rescale asks whether every process has built
UNIT_POLL_S = 0.01  # across processes, idle: how soon the next call runs the next unit of a build


@dataclasses.dataclass
class AdminError(Exception):
    message: str
    http_status: int = 400
    grpc_status: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT

    def __str__(self) -> str:
        return self.message


class RescaleRequest(pydantic.BaseModel):
    """``POST /admin/rescale`` body: ``{"attention": N, "experts": M}`` (+ ``slots_per_instance``)."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    attention: int = pydantic.Field(ge=1)
    experts: int = pydantic.Field(ge=1)
    slots_per_instance: int | None = pydantic.Field(default=None, ge=1)


class UnitedExpertsRequest(pydantic.BaseModel):
    """``POST /admin/united_experts`` body: ``{"path": DIR}``, a ``jaxmoe unite`` directory of the served
    model (on the server's file system)."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    path: str = pydantic.Field(min_length=1)


def parse_rescale(payload) -> RescaleRequest:
    """The validated request; ``AdminError`` naming the field otherwise."""
    return _parse(RescaleRequest, payload)


def _parse(model, payload):
    try:
        return model.model_validate(payload)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        raise AdminError(f"{field}: {err['msg']} (got {err.get('input')!r})") from None


def _start_rescale(attention: int, experts: int, slots: int | None, engine):
    return LiveRescaler.of(engine).start(attention, experts, slots)


def _apply_rescale(engine) -> bool:
    return LiveRescaler.of(engine).apply()


def rescale(async_engine, payload, timeout_s: float = 600.0) -> dict:
    """Change the attention / expert instances of the running engine; returns ``RescaleResult``'s
    fields once the new layout serves (build and compile in the background, swap at a step
    boundary). Errors: 400 / INVALID_ARGUMENT (does not fit: nothing changed), 409 / ABORTED (one is
    in progress), 504 / DEADLINE_EXCEEDED (not done in ``timeout_s``; it goes on)."""
    req = parse_rescale(payload)
    # multi-host: every process starts (and applies) the same rescale at the same point of the steps
    start = functools.partial(_start_rescale, req.attention, req.experts, req.slots_per_instance)
    deadline = time.monotonic() + timeout_s
    try:
        job = async_engine.call(start, timeout=timeout_s, replicate=start)
        if not job.agreed and not job.wait_ready(timeout_s):
            raise TimeoutError(f"the {job.target} layout was not built in {timeout_s}s")
        # built here (not failed nor cancelled): swap now when idle, else at the next step; across
        # processes only once every process has built (each call asks them all; while the engine is
        # idle each call also runs the next unit of a build made between steps): ask again meanwhile
        units = job.idle_units
        while not job.done() and not async_engine.call(_apply_rescale, replicate=_apply_rescale):
            if job.swapped or job.done():
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {job.target} layout was not built on every process in {timeout_s}s")
            time.sleep(UNIT_POLL_S if job.idle_units > units else APPLY_POLL_S)  # a unit ran: idle, go on
            units = job.idle_units
        return job.result(max(1.0, deadline - time.monotonic())).as_dict()
    except RescaleCancelledError as e:
        raise AdminError(str(e), 503, grpc.StatusCode.UNAVAILABLE) from None
    except RescaleInProgressError as e:
        raise AdminError(str(e), 409, grpc.StatusCode.ABORTED) from None
    except RescaleError as e:
        raise AdminError(str(e)) from None
    except TimeoutError as e:
        raise AdminError(f"rescale not done: {e}", 504, grpc.StatusCode.DEADLINE_EXCEEDED) from None
    finally:
        SERVING.refreeze()  # the old layout's objects are garbage now: let the collector see them


def load_united_experts(async_engine, payload, timeout_s: float = 600.0) -> dict:
    """BrownoutServe's Experts Loader (``jaxmoe.brownout.loader``): the served united experts replaced
    by those of ``payload["path"]`` between two steps, requests in flight going on; returns what was
    loaded. Errors: 400 / INVALID_ARGUMENT (does not fit: nothing changed), 504 / DEADLINE_EXCEEDED."""
    from jaxmoe.brownout.config import BrownoutError

    req = _parse(UnitedExpertsRequest, payload)
    load = functools.partial(_load_united, req.path)
    try:
        return async_engine.call(load, timeout=timeout_s, replicate=load)
    except (BrownoutError, OSError, ValueError) as e:  # does not fit, or unreadable: nothing changed
        raise AdminError(str(e)) from None
    except TimeoutError as e:
        raise AdminError(
            f"united experts not loaded in {timeout_s}s: {e}", 504, grpc.StatusCode.DEADLINE_EXCEEDED
        ) from None
    finally:
        SERVING.refreeze()  # the experts replaced are garbage now


def _load_united(path: str, engine) -> dict:
    from jaxmoe.brownout.loader import load_united_experts as load

    return load(engine, path)
