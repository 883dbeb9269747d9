"""What brownout does, as the user sets it: ``BrownoutConfig(threshold, use_full_brownout)``, the SALC
parameters (``SALCConfig``) with their ranges (``check_salc``), and ``BrownoutSettings``: both as a
server runs them, from the mesh file's ``brownout:`` section and ``jaxmoe serve`` flags."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError


class BrownoutError(ValueError):
    """A brownout setting out of range, or united experts that do not fit the model."""


@dataclasses.dataclass(frozen=True)
class BrownoutConfig:
    """``threshold`` in [0, 1]: the share of a step's expert assignments that stay with their
    original experts (1: zero brownout, the exact model); the rest go to united experts (partial
    brownout) or are dropped (``use_full_brownout``). ``prefill_threshold`` / ``decode_threshold``:
    the phase's own start threshold (None: ``threshold``), as the paper keeps one per phase."""

    threshold: float = 1.0
    use_full_brownout: bool = False
    prefill_threshold: float | None = None
    decode_threshold: float | None = None

    def __post_init__(self):
        check_threshold(self.threshold)
        for phase in ("prefill", "decode"):
            value = getattr(self, f"{phase}_threshold")
            if value is not None:
                check_threshold(value, f"{phase}_threshold")
        if not isinstance(self.use_full_brownout, bool):
            raise BrownoutError(f"use_full_brownout must be true or false, got {self.use_full_brownout!r}")

    @property
    def prefill(self) -> float:
        """The prefill phase's start threshold."""
        return float(self.threshold if self.prefill_threshold is None else self.prefill_threshold)

    @property
    def decode(self) -> float:
        """The decode phase's start threshold."""
        return float(self.threshold if self.decode_threshold is None else self.decode_threshold)


def check_threshold(value, name: str = "threshold") -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 <= value <= 1
    ):
        raise BrownoutError(f"brownout {name} must be a number in [0, 1], got {value!r}")
    return float(value)


RANGES = {
    "slo": ("> 0", lambda v: v > 0),
    "slo_ttft_s": ("> 0 seconds", lambda v: v > 0),
    "slo_tpot_s": ("> 0 seconds", lambda v: v > 0),
    "slo_ttft_ms": ("> 0 milliseconds", lambda v: v > 0),
    "slo_tpot_ms": ("> 0 milliseconds", lambda v: v > 0),
    "window": ("> 0 seconds", lambda v: v > 0),
    "period": (">= 0 seconds", lambda v: v >= 0),
    "warning_factor": ("in (0, 1]", lambda v: 0 < v <= 1),
    "increment": ("in (0, 1]", lambda v: 0 < v <= 1),
    "shrink_ratio": ("in (0, 1)", lambda v: 0 < v < 1),
}


def check_salc(**values) -> None:
    """Each SALC parameter (``RANGES``) a finite number in its range, else a ``BrownoutError``
    naming the parameter, its range and the value."""
    for name, value in values.items():
        what, ok = RANGES[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            raise BrownoutError(f"SALC {name} must be {what}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SALCConfig:
    """SALC (Algorithm 2) per phase: an SLO (P90 seconds) for TTFT and / or TPOT, the P90 window
    ``tw`` and the paper's warning factor, increment and shrink ratio."""

    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    window_s: float = 10.0  # tw
    warning_factor: float = 0.8
    increment: float = 0.1
    shrink_ratio: float = 0.8
    period_s: float = 0.0  # run Algorithm 2 at most this often (0: after every step); samples every step

    def __post_init__(self):
        if self.slo_ttft_s is None and self.slo_tpot_s is None:
            raise BrownoutError("SALC needs an SLO: slo_ttft_s and/or slo_tpot_s")
        _check_salc_fields(self)


def _check_salc_fields(c) -> None:
    """The SALC parameter fields shared by ``SALCConfig`` and ``BrownoutSettings``, each checked."""
    for name, value in (("slo_ttft_s", c.slo_ttft_s), ("slo_tpot_s", c.slo_tpot_s)):
        if value is not None:
            check_salc(**{name: value})
    check_salc(
        window=c.window_s,
        warning_factor=c.warning_factor,
        increment=c.increment,
        shrink_ratio=c.shrink_ratio,
        period=c.period_s,
    )


@dataclasses.dataclass(frozen=True)
class BrownoutSettings:
    """Brownout as a server runs it: the executor's start threshold and mode, and whether SALC moves
    the threshold (with its parameters). The mesh file's ``brownout:`` section gives one
    (``jaxmoe.mesh_file``); ``jaxmoe serve`` flags override its fields (``replace``)."""

    threshold: float = 1.0
    use_full_brownout: bool = False
    prefill_threshold: float | None = None  # None: threshold
    decode_threshold: float | None = None
    salc: bool = False
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    window_s: float = 10.0
    warning_factor: float = 0.8
    increment: float = 0.1
    shrink_ratio: float = 0.8
    period_s: float = 0.0

    def __post_init__(self):
        self.brownout()
        if not isinstance(self.salc, bool):
            raise BrownoutError(f"salc must be true or false, got {self.salc!r}")
        _check_salc_fields(self)
        self.salc_config()  # with salc on: an SLO is needed

    def brownout(self) -> BrownoutConfig:
        return BrownoutConfig(self.threshold, self.use_full_brownout, self.prefill_threshold, self.decode_threshold)

    def salc_config(self) -> SALCConfig | None:
        """The SALC parameters when ``salc`` is on, else None."""
        if not self.salc:
            return None
        return SALCConfig(
            self.slo_ttft_s,
            self.slo_tpot_s,
            self.window_s,
            self.warning_factor,
            self.increment,
            self.shrink_ratio,
            self.period_s,
        )

    def replace(self, **overrides) -> BrownoutSettings:
        """These settings with the fields of ``overrides`` that are not None replaced (flags given)."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})


def _salc(name: str, scale: float = 1.0):
    """A SALC number checked by ``check_salc`` (as the flags are), times ``scale`` (to seconds)."""

    def check(value):
        check_salc(**{name: value})
        return value

    return Annotated[float, BeforeValidator(check), AfterValidator(lambda value: value * scale)]


class MeshSection(BaseModel):
    """The mesh file's ``brownout:`` section (keys as written: SLOs in ms, ``tw`` and ``period`` in s) as
    ``BrownoutSettings`` fields; a key left out keeps its default there, an explicit null is refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
    salc: bool = None
    threshold: Annotated[float, BeforeValidator(check_threshold)] = None
    prefill_threshold: Annotated[float, BeforeValidator(lambda v: check_threshold(v, "prefill_threshold"))] = None
    decode_threshold: Annotated[float, BeforeValidator(lambda v: check_threshold(v, "decode_threshold"))] = None
    use_full_brownout: bool = None
    slo_ttft_s: _salc("slo_ttft_ms", 1e-3) = Field(None, alias="slo_ttft_ms")
    slo_tpot_s: _salc("slo_tpot_ms", 1e-3) = Field(None, alias="slo_tpot_ms")
    window_s: _salc("window") = Field(None, alias="tw")
    warning_factor: _salc("warning_factor") = None
    increment: _salc("increment") = None
    shrink_ratio: _salc("shrink_ratio") = None
    period_s: _salc("period") = Field(None, alias="period")


def settings_from_mesh(section, src: str = "<dict>") -> BrownoutSettings:
    """A mesh file's ``brownout:`` section (``ClusterSpec.brownout``, handed over as written) as
    ``BrownoutSettings``; a ``MeshConfigError`` names the file, the field and the value otherwise."""
    from jaxmoe.mesh import MeshConfigError
    from jaxmoe.mesh_file import one_line

    try:
        section = MeshSection.model_validate(section)
    except ValidationError as exc:
        raise one_line(exc, src, MeshSection, "brownout") from None
    if section.salc and section.slo_ttft_s is None and section.slo_tpot_s is None:
        raise MeshConfigError(f"{src}: brownout.salc: SALC needs an SLO: give slo_ttft_ms and/or slo_tpot_ms")
    return BrownoutSettings(**section.model_dump(exclude_unset=True))


def mesh_brownout(mesh) -> BrownoutSettings | None:
    """The validated ``brownout:`` section of ``mesh`` (a mesh file path, a parsed dict, a
    ``ClusterSpec`` or ``SubMeshes``); None when it has none."""
    from jaxmoe.mesh import ClusterSpec, SubMeshes, load_mesh

    if isinstance(mesh, SubMeshes):
        mesh = mesh.spec
    spec = mesh if isinstance(mesh, ClusterSpec) else load_mesh(mesh)
    return None if spec.brownout is None else settings_from_mesh(spec.brownout, spec.source)


def describe(b: BrownoutSettings) -> str:
    """One line: the start threshold, the mode and SALC's parameters (``jaxmoe mesh show``)."""
    mode = "full" if b.use_full_brownout else "partial"
    c = b.brownout()
    start = f"{c.prefill:g}" if c.prefill == c.decode else f"prefill {c.prefill:g}, decode {c.decode:g}"
    text = f"start threshold {start} ({mode} brownout), SALC "
    if not b.salc:
        return text + "off"
    slos = [f"{p} {s * 1e3:g} ms" for p, s in (("TTFT", b.slo_ttft_s), ("TPOT", b.slo_tpot_s)) if s is not None]
    return (
        text + f"on: P90 SLO {', '.join(slos)}, tw {b.window_s:g} s, warning_factor {b.warning_factor:g}, "
        f"increment {b.increment:g}, shrink_ratio {b.shrink_ratio:g}, period {b.period_s:g} s"
    )
