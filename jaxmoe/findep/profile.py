"""The FinDEP performance profile of one (mesh, model, dtype): fitted stage models, stored as JSON.

Stage models (FinDEP, arXiv:2512.21487, section 4.1), each per attention instance and per task:

========== ===================================== =================================================
stage      work terms                            runs on
========== ===================================== =================================================
attention  tokens, query-key pairs of the        attention instance (``t_a(m_a)``)
           micro-batch
shared     tokens of the micro-batch             attention instance (``t_s(m_a)``)
a2e, e2a   bytes one attention instance sends    the links between the sub-meshes
           for one expert chunk
expert     tokens of one chunk (all attention    expert instance (``t_e(m_e)``, with
           instances together)                   ``m_e = tokens * top_k / E``)
========== ===================================== =================================================

A profile is either measured (``jaxmoe profile``, fitting the stages directly from the runtime's own
programs, plus the GEMM / attention / communication base models of eq. 7-9 for the Fig. 7 plot), or
derived from base models alone (``derive_stages``: the paper's eq. 10-11 and the shared-expert,
expert and A2E models built on eq. 7-9 -- how the GPU-shaped profile from the paper's Fig. 7
parameters is made).

Measured profiles are cached per (mesh, model, dtype) under ``$JAXMOE_PROFILE_CACHE`` (default
``~/.cache/jaxmoe/profiles``): ``jaxmoe profile`` writes there too, and ``jaxmoe plan`` / ``serve
--pipeline findep`` without a profile read the cached one (``cached_profile``) instead of measuring
again. ``agreement`` says how far two profiles' stages are apart.

``host`` says what the hardware can overlap (``schedule.Host``): ``None`` (the GPU-shaped profile,
and the paper's model) means every resource is separate hardware; a measured profile carries the
host's concurrency and per-program dispatch time, fitted by ``measure.measure_host``.
"""

from __future__ import annotations

import hashlib
import math
import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxmoe.findep.linear import LinearModel
from jaxmoe.findep.schedule import Host

PROFILE_KIND = "jaxmoe-findep-profile"


class ProfileError(ValueError):
    """A profile that cannot be read, or that was made for another mesh, model or dtype."""


class Dims(BaseModel):
    """What the stage models need to know about the model and the layout."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden: int = Field(gt=0)  # M
    heads: int = Field(gt=0)  # n_h
    qk_head_dim: int = Field(gt=0)  # d_k
    v_head_dim: int = Field(gt=0)  # d_v
    expert_width: int = Field(gt=0)  # H
    shared_width: int = Field(ge=0)  # total width of the shared experts (0: none)
    num_experts: int = Field(gt=0)  # E
    top_k: int = Field(gt=0)
    moe_layers: int = Field(ge=0)
    dense_layers: int = Field(ge=0)
    dtype_bytes: int = Field(gt=0)
    attention_instances: int = Field(gt=0)  # ag
    expert_instances: int = Field(gt=0)  # eg


class BaseModels(BaseModel):
    """FinDEP eq. 7-9: GEMM time per m*k*n, attention time per its workload, transfer time per byte."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gemm: LinearModel
    attention: LinearModel
    comm: LinearModel


class StageModels(BaseModel):
    """Per-task stage times in seconds (see the module docstring for the work terms)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    attention: LinearModel  # (tokens, query-key pairs)
    shared: LinearModel | None = None  # (tokens); None: no shared experts on the attention side
    dense: LinearModel | None = None  # (tokens): dense-MLP layers (DeepSeek's first layers)
    a2e: LinearModel  # (bytes)
    expert: LinearModel  # (chunk tokens) or (chunk tokens, chunk tokens²): see expert_time
    e2a: LinearModel  # (bytes)

    def expert_time(self, tokens: float) -> float:
        """t_e of one chunk of ``tokens`` (all attention instances): alpha + beta x, plus gamma x² when
        the expert model was fitted with a convex term (``measure.fit_stages``: a measured profile on
        hardware where a larger expert program costs more per token, as XLA:CPU's does)."""
        m = self.expert
        return m(tokens) if len(m.betas) == 1 else m(tokens, tokens * tokens)


class HostModel(BaseModel):
    """How much of a step's work the hardware overlaps, measured (``measure.measure_host``).

    ``concurrency``: (sum of two programs' times alone) / (their time dispatched together), for
    programs on the attention and the expert sub-mesh; 1: one at a time; None: the pair overlaps
    fully (separate hardware: no work bound). ``dispatch``: host seconds per program the executor
    dispatches (asynchronously). ``timing_scale``: the share of the timing-mode (blocked) time the
    same steps took asynchronously (``measure.timing_scale``); the stage models are already scaled."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    concurrency: float | None = Field(default=None, ge=1.0)
    dispatch: float = Field(default=0.0, ge=0.0)
    timing_scale: float = Field(default=1.0, gt=0.0, le=1.0)  # asynchronous / blocked (stages scaled by it)
    samples: dict[str, list[list[float]]] = Field(default_factory=dict)  # measurement -> raw points

    def host(self) -> Host:
        return Host(concurrency=math.inf if self.concurrency is None else self.concurrency, dispatch=self.dispatch)


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["jaxmoe-findep-profile"] = PROFILE_KIND
    version: Literal[1] = 1
    mesh: str  # identity of the layout (mesh_identity)
    model: str  # identity of the model (model_identity)
    dtype: str
    device: str  # what the numbers were measured on, e.g. "cpu (2 cores)" or "A6000 (paper)"
    source: str  # "measured by jaxmoe profile" or where the parameters come from
    dims: Dims
    stages: StageModels
    base: BaseModels | None = None
    host: HostModel | None = None  # None: separate hardware per resource (the paper's model)
    samples: dict[str, list[list[float]]] = Field(default_factory=dict)  # fit -> [[x..., t], ...]

    def check(self, *, mesh: str | None = None, model: str | None = None, dtype: str | None = None) -> None:
        """Raise ProfileError naming the first field that does not match."""
        for field, want in (("mesh", mesh), ("model", model), ("dtype", dtype)):
            have = getattr(self, field)
            if want is not None and have != want:
                raise ProfileError(
                    f"profile was made for {field} {have!r}, not {want!r}: run `jaxmoe profile` for this {field}"
                )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return read_profile(cls, path)


def read_profile(cls, path: str | Path):
    """A pydantic profile model read from JSON; ProfileError naming the file and the first bad field."""
    path = Path(path)
    try:
        return cls.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"no profile at {path}") from None
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise ProfileError(f"{path}: field {where!r}: {first['msg']}") from None


def derive_stages(base: BaseModels, dims: Dims) -> StageModels:
    """Stage models from the base models (FinDEP eq. 1-4 with eq. 7-9 substituted, eq. 10-11).

    The attention GEMMs are the four projections (2 of width n_h d_k, 2 of width n_h d_v); its
    attention work per query-key pair is n_h (d_k + d_v). The shared experts are 3 GEMMs over
    their width; an expert instance runs E/eg experts, 3 GEMMs each, on m_e = tokens * top_k / E
    tokens per expert; A2E and E2A cost the communication model of the bytes sent.
    """
    gm, at, c = base.gemm, base.attention, base.comm
    d = dims
    per_token_proj = 2 * d.hidden * d.heads * d.qk_head_dim + 2 * d.hidden * d.heads * d.v_head_dim
    attention = LinearModel(
        alpha=4 * gm.alpha + at.alpha,
        betas=(gm.betas[0] * per_token_proj, at.betas[0] * d.heads * (d.qk_head_dim + d.v_head_dim)),
    )
    shared = None
    if d.shared_width:
        shared = LinearModel(alpha=3 * gm.alpha, betas=(3 * gm.betas[0] * d.hidden * d.shared_width,))
    experts_per_instance = d.num_experts / d.expert_instances
    expert = LinearModel(
        alpha=3 * experts_per_instance * gm.alpha,
        betas=(3 * gm.betas[0] * d.hidden * d.expert_width * d.top_k / d.expert_instances,),
    )
    comm = LinearModel(alpha=c.alpha, betas=c.betas)
    return StageModels(attention=attention, shared=shared, a2e=comm, expert=expert, e2a=comm)


def model_identity(cfg) -> str:
    """A short, stable name for a ModelConfig: family, sizes and a hash of the whole config."""
    digest = hashlib.sha1(cfg.to_json().encode()).hexdigest()[:8]
    return (
        f"{cfg.family}-L{cfg.num_layers}-D{cfg.hidden_size}-E{cfg.moe.num_experts}k{cfg.moe.top_k}"
        f"-F{cfg.moe.intermediate_size}-{digest}"
    )


def mesh_identity(spec) -> str:
    """A short, stable name for a ClusterSpec: platform, attention/expert instances and their sizes."""
    a, e = spec.attention, spec.experts
    key = json.dumps(
        [
            spec.platform,
            spec.nodes,
            spec.devices_per_node,
            a.devices,
            e.devices,
            e.slots_per_instance,
            spec.shared_experts,
        ],
        sort_keys=True,
    )
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    return f"{spec.platform}-{a.count}a{e.count}e-{digest}"


def dims_of(cfg, spec, dtype_bytes: int) -> Dims:
    """Dims of a ModelConfig on a ClusterSpec."""
    att = cfg.attn
    qk = att.head_dim if att.kind == "gqa" else att.qk_nope_head_dim + att.qk_rope_head_dim
    v = att.head_dim if att.kind == "gqa" else att.v_head_dim
    shared_on_attention = spec.shared_experts == "attention"
    return Dims(
        hidden=cfg.hidden_size,
        heads=att.num_heads,
        qk_head_dim=qk,
        v_head_dim=v,
        expert_width=cfg.moe.intermediate_size,
        shared_width=cfg.moe.shared_intermediate_size if shared_on_attention else 0,
        num_experts=cfg.moe.num_experts,
        top_k=cfg.moe.top_k,
        moe_layers=cfg.num_moe_layers,
        dense_layers=cfg.num_layers - cfg.num_moe_layers,
        dtype_bytes=dtype_bytes,
        attention_instances=spec.attention.count,
        expert_instances=spec.experts.count,
    )


CACHE_ENV = "JAXMOE_PROFILE_CACHE"
STAGE_NAMES = ("attention", "shared", "dense", "a2e", "expert", "e2a")


def cache_dir() -> Path:
    """Where measured profiles are cached: ``$JAXMOE_PROFILE_CACHE``, else
    ``$XDG_CACHE_HOME/jaxmoe/profiles`` (``~/.cache/jaxmoe/profiles``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxmoe" / "profiles"


def cache_path(mesh: str, model: str, dtype: str) -> Path:
    """The cache file of a (mesh identity, model identity, dtype)."""
    name = "__".join(_safe(v) for v in (mesh, model, dtype))
    return cache_dir() / f"{name}.json"


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def cache_profile(profile: Profile) -> Path:
    """Store a measured profile as the cached one of its (mesh, model, dtype); returns the file."""
    return profile.save(cache_path(profile.mesh, profile.model, profile.dtype))


def cached_profile(mesh: str, model: str, dtype: str) -> Profile | None:
    """The cached measured profile of a (mesh, model, dtype), or None when there is none. A cached
    file that cannot be read, or whose identity does not match its name, is a ProfileError naming it."""
    path = cache_path(mesh, model, dtype)
    if not path.exists():
        return None
    profile = Profile.load(path)
    profile.check(mesh=mesh, model=model, dtype=dtype)
    return profile


def agreement(a: Profile, b: Profile) -> dict[str, float]:
    """Per stage both profiles have: how far apart their fitted stage times are over the work points
    either profile measured, |sum t_a - sum t_b| / min(sum t_a, sum t_b) (0.2: 20 % apart). Summed
    over the sweep, so one ill-conditioned fit at one point does not decide it."""
    out = {}
    for stage in STAGE_NAMES:
        ma, mb = getattr(a.stages, stage), getattr(b.stages, stage)
        if ma is None or mb is None:
            continue
        xs = sorted({tuple(p[:-1]) for p in a.samples.get(stage, []) + b.samples.get(stage, [])})
        if not xs:
            continue

        def total(profile: Profile, stage: str = stage) -> float:
            if stage == "expert":
                return sum(profile.stages.expert_time(x[0]) for x in xs)
            return sum(getattr(profile.stages, stage)(*x) for x in xs)

        ta, tb = total(a), total(b)
        lo = min(ta, tb)
        out[stage] = abs(ta - tb) / lo if lo > 0 else (0.0 if ta == tb else math.inf)
    return out
