"""The schedule of the disaggregated executor, chosen by name (``LLM(path, mesh=FILE, pipeline=...)``,
``jaxmoe serve --pipeline ...``): what ``pipeline_chooser`` turns each value into.

* ``"sequential"``: every task of a layer one after the other (``Pipeline.sequential()``).
* ``"pppipe"``: PPPipe (MegaScale-Infer's ping-pong pipeline): r1 micro-batches alternate between
  the attention and expert groups, shared experts run with attention (no overlap), no expert-side
  chunking (r2 = 1); r1 is the best for each batch shape under the profile (``solver.pppipe``).
* ``"findep"``: FinDEP's solver (Algorithm 1, ``solver.solve``) for each batch shape: order
  (ASAS / AASS), r1 and r2.
* a dict ``{"order": "ASAS", "r1": 2, "r2": 4}``: that configuration for every step (each step runs
  the largest r1 / r2 dividing its rows / tokens per instance: ``Pipeline.for_batch``;
  ``FixedChooser``).

Every pipelined plan carries its dispatch sequence (``Pipeline.dispatch``): the solver's event
model (``schedule.dispatch_order``) under the profile's stage times for that batch shape, so the
executor dispatches its programs in the order the model times them.

``pppipe`` and ``findep`` need a profile (``jaxmoe profile``): pass its path. It must be for this
mesh, model and dtype (``Profile.check``: a ProfileError names the field). Without one they use the
profile cached for this mesh, model and dtype (``profile.cached_profile``: ``jaxmoe profile`` or
``jaxmoe plan`` stored it; nothing is measured at start-up), and when none is cached the
profile-free default: the stage models derived from FinDEP's Fig. 7 parameters (8x A6000,
``paper_profile``) for this model's and mesh's dimensions: a GPU-shaped guess, not a measurement
of this machine (on CPU it favours more pipelining than pays; measure a profile to do better).

Plans are cached per batch shape: (rows per instance, tokens per sequence, attended tokens rounded
up to a power of two), so a decode step whose context grows by one token reuses the plan.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxmoe.findep.paper_profile import paper_profile
from jaxmoe.findep.profile import Profile, cached_profile, dims_of, mesh_identity, model_identity
from jaxmoe.findep.schedule import dispatch_order, layer_kinds
from jaxmoe.findep.solver import BatchShape, pppipe, solve, stage_times
from jaxmoe.runtime.pipeline import NAMES, Pipeline


def with_dispatch(pipe: Pipeline, profile: Profile, shape: BatchShape, layers: tuple[bool, ...]) -> Pipeline:
    """``pipe`` (the configuration that runs for ``shape``) with its dispatch sequence: the event
    model's order (``schedule.dispatch_order``) under the profile's stage times for that shape."""
    times = stage_times(profile, shape, shape.batch // pipe.r1, pipe.r2)
    return dataclasses.replace(pipe, dispatch=dispatch_order(times, pipe.order, pipe.r1, pipe.r2, layers))


class _Chooser:
    """Plans per batch shape (rows, tokens, attended rounded up to a power of two), cached, each
    with its dispatch sequence from the event model (``with_dispatch``)."""

    def __init__(self, profile: Profile, layers: tuple[bool, ...] | None = None):
        d = profile.dims
        self.profile = profile
        self.layers = tuple(layers) if layers is not None else layer_kinds(d.moe_layers, d.dense_layers)
        self.cache: dict[tuple[int, int, int], Pipeline] = {}

    def for_batch(self, rows: int, tokens: int, context: int = 0) -> Pipeline:
        key = (rows, tokens, 1 << max(0, int(context) - 1).bit_length())
        pipe = self.cache.get(key)
        if pipe is None:
            shape = BatchShape(rows, tokens, max(key[2], tokens))
            pipe = self.cache[key] = with_dispatch(self.plan(shape), self.profile, shape, self.layers)
        return pipe

    def plan(self, shape: BatchShape) -> Pipeline:
        raise NotImplementedError


class SolverChooser(_Chooser):
    """``PipelineChooser`` of "findep" / "pppipe": the solver's plan per batch shape."""

    def __init__(self, name: str, profile: Profile, layers: tuple[bool, ...] | None = None):
        super().__init__(profile, layers)
        self.name = name

    def plan(self, shape: BatchShape) -> Pipeline:
        plan = solve(self.profile, shape) if self.name == "findep" else pppipe(self.profile, shape)
        return Pipeline(plan.r1, plan.order, plan.r2).for_batch(shape.batch, shape.tokens)

    def __repr__(self) -> str:
        return f"SolverChooser({self.name!r}, profile={self.profile.source!r}, {len(self.cache)} shapes cached)"


class FixedChooser(_Chooser):
    """``PipelineChooser`` of a fixed configuration (``{"order", "r1", "r2"}``): that configuration
    (``Pipeline.for_batch``) for every shape, dispatched in the event model's order."""

    def __init__(self, pipeline: Pipeline, profile: Profile, layers: tuple[bool, ...] | None = None):
        super().__init__(profile, layers)
        self.fixed = pipeline

    def plan(self, shape: BatchShape) -> Pipeline:
        return self.fixed.for_batch(shape.batch, shape.tokens)

    def __repr__(self) -> str:
        return f"FixedChooser({self.fixed!r}, profile={self.profile.source!r})"


def parse_pipeline(text: str):
    """A ``--pipeline`` command-line value: a name, or a JSON object like '{"order": "ASAS", "r1": 2}'."""
    text = text.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except ValueError as e:
            raise ValueError(f"--pipeline {text!r}: not a JSON object ({e})") from None
    return text


def pipeline_chooser(
    value,
    cfg,
    spec,
    dtype: str,
    dtype_bytes: int,
    *,
    profile: str | Path | Profile | None = None,
    max_rows: int | None = None,
    max_tokens: int | None = None,
):
    """The executor's ``pipeline`` for a schedule value (see the module docstring).

    ``max_rows`` / ``max_tokens``: the most sequences / new tokens per attention instance a step can
    have; a fixed r1 (r2) above them could never run and is an error naming the value."""
    if isinstance(value, str) and value not in NAMES:
        raise ValueError(f"pipeline {value!r}: expected one of {NAMES} or a dict like {{'order': 'ASAS', 'r1': 2}}")
    layers = tuple(cfg.moe_layers)
    if value in ("pppipe", "findep"):
        return SolverChooser(value, _profile(profile, cfg, spec, dtype, dtype_bytes), layers)
    pipe = Pipeline.parse(value)
    if isinstance(pipe, Pipeline) and pipe != Pipeline.sequential():
        if max_rows is not None and pipe.r1 > max_rows:
            raise ValueError(
                f"pipeline r1={pipe.r1} is impossible: a step has at most {max_rows} sequences per attention instance"
            )
        if max_tokens is not None and pipe.r2 > max_tokens:
            raise ValueError(
                f"pipeline r2={pipe.r2} is impossible: a step has at most {max_tokens} tokens per attention instance"
            )
        return FixedChooser(pipe, _profile(profile, cfg, spec, dtype, dtype_bytes), layers)
    return pipe


def _profile(profile, cfg, spec, dtype: str, dtype_bytes: int) -> Profile:
    mesh, model = mesh_identity(spec), model_identity(cfg)
    if profile is None:
        cached = cached_profile(mesh, model, dtype)
        return cached if cached is not None else paper_profile(dims_of(cfg, spec, dtype_bytes), mesh, model, dtype)
    if not isinstance(profile, Profile):
        profile = Profile.load(profile)
    profile.check(mesh=mesh, model=model, dtype=dtype)
    return profile
