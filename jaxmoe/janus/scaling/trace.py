"""A synthetic two-day request trace: diurnal, bursty, seeded.

Shape (per minute): ``rate(t) = mean x (1 + A sin(2 pi (t - peak_hour) / 24 h + pi / 2))`` with ``A``
set by the peak-to-trough ratio, times bursts (a Poisson number per day; each multiplies the rate by
a uniform factor for a uniform number of minutes) and a lognormal per-minute jitter. Request
lengths use the means JANUS (arXiv:2512.13525, section 5.1) reports for its ShareGPT-derived
workload: 16 input and 256 output tokens. The numbers are ours, chosen to resemble production
traces like BurstGPT's (daily cycle, bursts of minutes); they are not fitted to a released trace.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class TraceShape:
    days: float = 2.0
    mean_rate: float = 6.0  # requests per second, averaged over a day
    peak_to_trough: float = 4.0
    peak_hour: float = 14.0
    bursts_per_day: float = 6.0
    burst_factor: tuple[float, float] = (1.5, 2.5)
    burst_minutes: tuple[int, int] = (5, 30)
    jitter: float = 0.08  # sigma of the per-minute lognormal noise
    input_tokens: float = 16.0
    output_tokens: float = 256.0

    def __post_init__(self):
        if self.days <= 0 or self.mean_rate <= 0 or self.peak_to_trough < 1:
            raise ValueError(f"days, mean_rate must be > 0 and peak_to_trough >= 1, got {self}")


def synthesize(shape: TraceShape = TraceShape(), seed: int = 0) -> np.ndarray:
    """Requests per second of every minute [minutes]."""
    rng = np.random.default_rng(seed)
    minutes = int(round(shape.days * 24 * 60))
    t = np.arange(minutes) / 60.0  # hours
    amp = (shape.peak_to_trough - 1) / (shape.peak_to_trough + 1)
    rate = shape.mean_rate * (1 + amp * np.cos(2 * np.pi * (t - shape.peak_hour) / 24.0))
    for _ in range(rng.poisson(shape.bursts_per_day * shape.days)):
        start = rng.integers(0, minutes)
        length = rng.integers(shape.burst_minutes[0], shape.burst_minutes[1] + 1)
        rate[start : start + length] *= rng.uniform(*shape.burst_factor)
    return rate * rng.lognormal(0.0, shape.jitter, minutes)
