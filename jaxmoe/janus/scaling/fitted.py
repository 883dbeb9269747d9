"""The JANUS scaling profile: a decode-step model of the disaggregated runtime, fitted from the
runtime's own measurements on the target mesh (JANUS, arXiv:2512.13525, section 3.4), stored as
JSON like FinDEP's profile (``planning.profile``; the same alpha-beta ``LinearModel`` fits).

Per layer of a decode step on layout aXeY (a attention instances, N = Y expert instances of C slots),
with b rows per attention instance (the engine pads a step's rows to a power of two per instance,
``engine.buckets``), B = a x b rows and c tokens attended:

=========  ========================================  ==============================================
fit        work terms                                what they stand for
=========  ========================================  ==============================================
attention  a, B, B x c, b x c                        one program dispatch per instance; the total
                                                     work (host devices share the cores) and the
                                                     per-instance work (separate devices)
expert     N, activated experts of the busiest       dispatch per instance; JANUS's Fig. 1 finding
           instance and of all instances, N x B,     (an MoE layer's time grows with the experts an
           N x B where B exceeds the FFN form's      instance activates; on host devices sharing
           own range                                 the cores, with all of them); gate and grouped
                                                     matmul over every instance's rows, dearer where the
                                                     FFN form falls back (``expert_ffn
                                                     .fallback_above``: the CPU kernel's plain
                                                     weights take decode-sized batches only)
a2e, e2a   puts, array ops, shards, bytes            the host calls of the layout's transfer plan
                                                     (``runtime.transfer_walk.host_ops``: copies, the
                                                     slices / concatenations / sums around them,
                                                     the shards assembled) and its bytes
step       B, the parts' sum                         the engine's decode step (measured TPOT): the
                                                     parts as served (not blocked per phase), the
                                                     embedding, LM head, sampling and scheduler
=========  ========================================  ==============================================

``TPOT = step(B, layers x attention + MoE layers x (a2e + expert + e2a))``. The activated experts
of a prediction are the expected numbers (``perf_model.activated_per_instance``: an even share under
AEBS, a balls-in-bins maximum under random scheduling; ``perf_model.distinct_experts`` in all). ``FittedPerfModel`` answers the scaling
controller's ``DisaggregatedPerf`` protocol; ``jaxmoe.janus.scaling.fit`` measures and fits a profile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxmoe.engine.buckets import bucket
from jaxmoe.mesh import ClusterSpec
from jaxmoe.findep.linear import LinearModel
from jaxmoe.findep.profile import ProfileError, read_profile
from jaxmoe.janus.reshard import rescaled_spec
from jaxmoe.runtime.transfer import TransferPlan, plan_transfers
from jaxmoe.runtime.transfer_walk import host_ops
from jaxmoe.janus.scaling.perf_model import activated_per_instance, distinct_experts

SCALING_PROFILE_KIND = "jaxmoe-scaling-profile"


class ScalingDims(BaseModel):
    """What a prediction needs to know about the model and the mesh."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: int = Field(gt=0)
    moe_layers: int = Field(ge=0)
    experts: int = Field(gt=0)
    top_k: int = Field(gt=0)
    hidden: int = Field(gt=0)
    dtype_bytes: int = Field(gt=0)
    slots_per_instance: int = Field(gt=0)
    num_devices: int = Field(gt=0)
    fallback_above: int | None = Field(default=None, gt=0)  # tokens: above, the expert FFN's fallback runs


class ScalingFits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    attention: LinearModel  # (a, B, B*c, b*c) -> seconds per layer
    expert: LinearModel  # (N, activated: busiest instance, all; N*B, N*B in the fallback) -> s per MoE layer
    a2e: LinearModel  # (puts, array ops, shards, bytes)
    e2a: LinearModel  # (puts, array ops, shards, bytes)
    step: LinearModel  # (B, parts) -> the engine's decode step (TPOT)


class ScalingProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["jaxmoe-scaling-profile"] = SCALING_PROFILE_KIND
    version: Literal[2] = 2  # 2: host-call transfer terms and the expert fallback term
    mesh: str  # mesh_family(spec): the devices and slots, any aXeY layout on them
    model: str  # planning.profile.model_identity
    dtype: str
    device: str
    source: str
    dims: ScalingDims
    fits: ScalingFits
    samples: dict[str, list[list[float]]] = Field(default_factory=dict)  # fit -> [[terms..., seconds], ...]

    def check(self, *, mesh: str | None = None, model: str | None = None, dtype: str | None = None) -> None:
        """Raise ProfileError naming the first field that does not match."""
        for field, want in (("mesh", mesh), ("model", model), ("dtype", dtype)):
            have = getattr(self, field)
            if want is not None and have != want:
                raise ProfileError(
                    f"scaling profile was made for {field} {have!r}, not {want!r}: fit one for this {field} "
                    "(jaxmoe scaling-profile --mesh FILE --model DIR --out DIR)"
                )

    def r2(self) -> dict[str, float | None]:
        return {name: getattr(self.fits, name).r2 for name in ScalingFits.model_fields}

    @property
    def filename(self) -> str:
        """The name ``find_profile`` looks for in a directory: mesh family, model and dtype."""
        return profile_filename(self.mesh, self.model, self.dtype)

    def save(self, path: str | Path) -> Path:
        """Write the JSON to ``path`` (a directory: under ``filename`` there)."""
        path = Path(path)
        if path.is_dir():
            path = path / self.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> ScalingProfile:
        return read_profile(cls, path)


def profile_filename(mesh: str, model: str, dtype: str) -> str:
    return f"scaling-{mesh}-{model}-{dtype}.json"


def find_profile(directory: str | Path, mesh: str, model: str, dtype: str) -> Path | None:
    """The profile for (mesh family, model, dtype) in ``directory``, or None when there is none."""
    path = Path(directory) / profile_filename(mesh, model, dtype)
    return path if path.is_file() else None


def mesh_family(spec: ClusterSpec) -> str:
    """The identity of a mesh's devices and expert slots (every aXeY layout on them shares it)."""
    key = json.dumps([spec.platform, spec.nodes, spec.devices_per_node, spec.experts.slots_per_instance])
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    return f"{spec.platform}-{spec.nodes}x{spec.devices_per_node}-C{spec.experts.slots_per_instance}-{digest}"


# -- work terms: one definition for the fit (measured values) and the prediction (expected ones) ----
def attention_terms(attention: int, rows: int, context: float) -> list[float]:
    B = attention * rows
    return [attention, B, B * context, rows * context]


def expert_terms(
    experts: int, busiest: float, activated: float, rows_total: int, fallback_above: int | None
) -> list[float]:
    fallback = fallback_above is not None and rows_total > fallback_above
    return [experts, busiest, activated, experts * rows_total, experts * rows_total * fallback]


def transfer_terms(spec: ClusterSpec, plan: TransferPlan, direction: str) -> list[float]:
    """A2E or E2A of ``plan`` on ``spec``'s devices: its host calls (``transfer_walk.host_ops``) and bytes."""
    ops = host_ops(spec, plan)[direction]
    return [ops.puts, ops.ops, ops.shards, plan.counts(direction).nbytes]


def step_terms(rows_total: int, parts: float) -> list[float]:
    return [rows_total, parts]


def padded_rows(batch: float, attention: int) -> int:
    """Rows per attention instance of a decode step of ``batch`` sequences (balanced, padded)."""
    return bucket(max(1, math.ceil(batch / attention)))


def layout_spec(base: ClusterSpec, attention: int, experts: int, two_phase: bool = True) -> ClusterSpec:
    """aXeY on ``base``'s devices (``rescaled_spec``), with direct transfers unless ``two_phase``
    (two-phase: the mesh file's policy, or ``two_phase`` where it says ``direct``)."""
    spec = rescaled_spec(base, attention, experts)
    mode = spec.transfer.mode if two_phase else "direct"
    if two_phase and mode == "direct":
        mode = "two_phase"
    return dataclasses.replace(spec, transfer=dataclasses.replace(spec.transfer, mode=mode))


class FittedPerfModel:
    """A ``DisaggregatedPerf`` from a ``ScalingProfile`` for layouts on ``base``'s devices.

    ``kv_tokens``: tokens the engine's KV cache holds (all attention instances together);
    ``max_batch``: the most sequences a step runs (``max_num_seqs``)."""

    def __init__(self, profile: ScalingProfile, base: ClusterSpec, kv_tokens: int, max_batch: int):
        profile.check(mesh=mesh_family(base))
        self.profile, self.base, self.kv_tokens, self.max_batch = profile, base, kv_tokens, max_batch
        self.dims = profile.dims

    def parts(
        self, batch: float, context: float, attention: int, experts: int, balanced: bool = True, two_phase: bool = True
    ) -> dict[str, float]:
        """Per-layer seconds of each part, the rows the step runs, and the predicted TPOT."""
        d, f = self.dims, self.profile.fits
        rows = padded_rows(batch, attention)
        B = attention * rows
        act = activated_per_instance(d.experts, d.top_k, batch, experts, d.slots_per_instance, balanced)
        distinct = distinct_experts(d.experts, d.top_k, batch)
        spec = layout_spec(self.base, attention, experts, two_phase)
        plan = plan_transfers(spec, rows * d.hidden * d.dtype_bytes)
        out = {
            "rows": B,
            "activated": act,
            "attention": f.attention(*attention_terms(attention, rows, context)),
            "expert": f.expert(*expert_terms(experts, act, distinct, B, d.fallback_above)),
            "a2e": f.a2e(*transfer_terms(spec, plan, "a2e")),
            "e2a": f.e2a(*transfer_terms(spec, plan, "e2a")),
        }
        out["sum"] = d.layers * out["attention"] + d.moe_layers * (out["a2e"] + out["expert"] + out["e2a"])
        out["tpot"] = f.step(*step_terms(B, out["sum"]))
        return out

    def tpot_disaggregated(
        self, batch: float, context: float, attention: int, experts: int, balanced: bool = True, two_phase: bool = True
    ) -> float:
        return self.parts(batch, context, attention, experts, balanced, two_phase)["tpot"]

    def kv_capacity(self, attention: int, context: float) -> float:
        """Sequences of ``context`` tokens a step can hold: the KV cache's tokens (split over the
        attention instances, so independent of their number) and ``max_batch``."""
        return min(float(self.max_batch), self.kv_tokens / max(context, 1.0))
