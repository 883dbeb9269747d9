"""The scipy-free non-negative least squares behind the planners' linear fits agrees with
``scipy.optimize.nnls`` (where scipy is installed) and with the constraint."""

from __future__ import annotations

import numpy as np
import pytest

from jaxmoe.findep.linear import LinearModel, nnls


@pytest.mark.parametrize("seed", range(20))
def test_matches_scipy_and_is_non_negative(seed):
    scipy_nnls = pytest.importorskip("scipy.optimize").nnls
    rng = np.random.default_rng(seed)
    m, n = int(rng.integers(3, 40)), int(rng.integers(1, 6))
    A = rng.normal(size=(m, n))
    b = rng.normal(size=m) * 3
    x, r = nnls(A, b)
    want, want_r = scipy_nnls(A, b)
    assert (x >= 0).all()
    assert r == pytest.approx(want_r, rel=1e-7, abs=1e-9)
    np.testing.assert_allclose(x, want, atol=1e-7)


@pytest.mark.slow
def test_recovers_a_non_negative_fit():
    rng = np.random.default_rng(1)
    X = rng.uniform(1, 1e6, size=(50, 2))
    t = 0.5 + X @ np.array([2e-6, 0.0]) + rng.normal(scale=1e-3, size=50)
    fit = LinearModel.fit(X, t)
    assert fit.alpha == pytest.approx(0.5, abs=0.01) and fit.betas[0] == pytest.approx(2e-6, rel=0.01)
    assert fit.betas[1] >= 0 and fit.r2 > 0.99
