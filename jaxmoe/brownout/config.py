"""What brownout does, as the user sets it: ``BrownoutConfig(threshold, use_full_brownout)``."""

from __future__ import annotations

import dataclasses
import math


class BrownoutError(ValueError):
    """A brownout setting out of range, or united experts that do not fit the model."""


@dataclasses.dataclass(frozen=True)
class BrownoutConfig:
    """``threshold`` in [0, 1]: the share of a step's expert assignments that stay with their
    original experts (1: zero brownout, the exact model); the rest go to united experts (partial
    brownout) or are dropped (``use_full_brownout``)."""

    threshold: float = 1.0
    use_full_brownout: bool = False

    def __post_init__(self):
        check_threshold(self.threshold)
        if not isinstance(self.use_full_brownout, bool):
            raise BrownoutError(f"use_full_brownout must be true or false, got {self.use_full_brownout!r}")


def check_threshold(value) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 <= value <= 1
    ):
        raise BrownoutError(f"brownout threshold must be a number in [0, 1], got {value!r}")
    return float(value)
