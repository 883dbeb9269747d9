"""Alpha-beta performance models: ``t(x) = alpha + beta . x`` fitted by non-negative least squares.

FinDEP (arXiv:2512.21487, eq. 7-9) models every computation and communication task as a fixed
start-up cost plus a cost per unit of work. The coefficients are kept non-negative, which the
solver's monotonicity and convexity arguments need. A model may have several work terms (the
attention stage costs per token and per query-key pair).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


def nnls(A: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative least squares, min ||A x - b|| with x >= 0 (Lawson and Hanson's active-set
    method, "Solving Least Squares Problems", ch. 23): (x, residual norm), as
    ``scipy.optimize.nnls``. The fits here have a handful of columns, so numpy's ``lstsq`` on the
    passive set is all it needs."""
    A, b = np.asarray(A, float), np.asarray(b, float)
    m, n = A.shape
    passive = np.zeros(n, bool)
    x = np.zeros(n)
    tol = 10 * np.finfo(float).eps * np.abs(A).sum(axis=0).max(initial=0.0) * max(m, n)

    def solve(mask):
        s = np.zeros(n)
        if mask.any():
            s[mask] = np.linalg.lstsq(A[:, mask], b, rcond=None)[0]
        return s

    for _ in range(3 * n + 1):
        w = A.T @ (b - A @ x)
        if passive.all() or np.where(passive, -np.inf, w).max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        s = solve(passive)
        for _ in range(3 * n + 1):  # step back until every passive coefficient is positive
            bad = passive & (s <= tol)
            if not bad.any():
                break
            alpha = np.min(x[bad] / (x[bad] - s[bad]))
            x = x + alpha * (s - x)
            passive &= x > tol
            s = solve(passive)
        x = s
    return x, float(np.linalg.norm(A @ x - b))


class LinearModel(BaseModel):
    """``alpha + sum(beta_k * x_k)``; ``r2`` and ``points`` describe the fit (None/0: given, not fitted)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    alpha: float = Field(ge=0.0)
    betas: tuple[float, ...] = Field(min_length=1)
    r2: float | None = None
    points: int = Field(default=0, ge=0)

    def __call__(self, *x: float) -> float:
        betas = self.betas
        if len(x) != len(betas):
            raise ValueError(f"model has {len(betas)} work terms, got {len(x)}")
        return self.alpha + (betas[0] * x[0] if len(x) == 1 else sum(b * v for b, v in zip(betas, x)))

    @classmethod
    def fit(cls, x: Sequence[float] | Sequence[Sequence[float]], y: Sequence[float]) -> LinearModel:
        """Least-squares fit with alpha, betas >= 0; ``x`` is [n] (one work term) or [n, k]."""
        X = np.asarray(x, dtype=np.float64)
        if X.ndim == 1:
            X = X[:, None]
        t = np.asarray(y, dtype=np.float64)
        if X.shape[0] != t.shape[0] or X.shape[0] < X.shape[1] + 1:
            raise ValueError(
                f"need at least {X.shape[1] + 1} (x, y) points with matching lengths, got "
                f"{X.shape[0]} x and {t.shape[0]} y"
            )
        # Scale the columns so that the solver sees comparable magnitudes (work terms can be 1e12).
        scale = np.maximum(np.abs(X).max(axis=0), 1e-30)
        A = np.concatenate([np.ones((X.shape[0], 1)), X / scale], axis=1)
        coef, _ = nnls(A, t)
        pred = A @ coef
        ss_res = float(((t - pred) ** 2).sum())
        ss_tot = float(((t - t.mean()) ** 2).sum())
        r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
        return cls(alpha=float(coef[0]), betas=tuple(float(b) for b in coef[1:] / scale), r2=r2, points=len(t))
