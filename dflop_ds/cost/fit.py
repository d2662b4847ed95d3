"""Monotone, non-negative regressions on named size features (scikit-learn underneath).

A fit is ``y = sum_k c_k * phi_k(size)`` with every ``c_k >= 0`` and every feature ``phi_k`` a
non-negative, non-decreasing function of the size variables. That makes every prediction
non-negative and monotone in every size variable, whatever the measurements' noise.
Times are fitted on relative error (weights ``1 / y**2``), since the accuracy that matters to
a scheduler is relative, and with a Huber loss (iteratively reweighted least squares), so that
a timing spoiled by another process on the machine does not bend the curve.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

Feature = Callable[[Mapping[str, np.ndarray]], np.ndarray]

#: Size variables: ``T`` encoder tiles, ``A`` encoder attention units (the sum over attention windows
#: of their squared units), ``B`` microbatch samples, ``S`` padded sequence length.
FEATURES: dict[str, Feature] = {
    "1": lambda v: np.ones_like(next(iter(v.values())), dtype=float),
    "T": lambda v: v["T"],
    "T^2": lambda v: v["T"] ** 2,
    "A": lambda v: v["A"],
    "B": lambda v: v["B"],
    "B*S": lambda v: v["B"] * v["S"],
    "B*S^2": lambda v: v["B"] * v["S"] ** 2,
}


def design_matrix(features: Sequence[str], variables: Mapping[str, np.ndarray]) -> np.ndarray:
    """Columns ``phi_k(variables)`` for the named features."""
    unknown = [name for name in features if name not in FEATURES]
    if unknown:
        raise ValueError(f"unknown features {unknown}; known: {sorted(FEATURES)}")
    arrays = {k: np.asarray(v, dtype=float) for k, v in variables.items()}
    return np.stack([FEATURES[name](arrays) for name in features], axis=1)


class MonotoneFit:
    """Non-negative least squares on named monotone features.

    Args:
        features: names from :data:`FEATURES` (``"1"`` is the intercept).
        relative: fit relative rather than absolute error.
        huber: residuals (relative, or in units of the median ``|y|``) beyond this count as
            outliers and get a linearly decreasing weight; ``None`` for plain least squares.
        iterations: reweighting rounds of the Huber fit.
    """

    def __init__(
        self, features: Sequence[str], relative: bool = True, huber: float | None = 0.05, iterations: int = 8
    ) -> None:
        self.features = tuple(features)
        self.relative = relative
        self.huber = huber
        self.iterations = iterations
        design_matrix(self.features, {"T": np.zeros(1), "A": np.zeros(1), "B": np.zeros(1), "S": np.zeros(1)})

    def fit(self, variables: Mapping[str, ArrayLike], y: ArrayLike, scale: ArrayLike | None = None) -> MonotoneFit:
        """Fit to measurements ``y`` at ``variables``; sets ``coef_``.

        With ``relative``, errors are measured relative to ``scale`` (default ``y``): pass the
        total time when fitting one part of it, so that a part near zero is not overweighted.
        """
        X = design_matrix(self.features, {k: np.asarray(v, dtype=float) for k, v in variables.items()})
        target = np.asarray(y, dtype=float)
        if len(target) == 0:
            raise ValueError("cannot fit on zero measurements")
        reference = np.median(np.abs(target)) * np.ones_like(target)
        if self.relative:
            reference = np.abs(target if scale is None else np.asarray(scale, dtype=float))
        reference = np.maximum(reference, 1e-12)
        base = 1.0 / reference**2
        robust = np.ones_like(target)
        rounds = 1 if self.huber is None else max(1, self.iterations)
        from sklearn.linear_model import LinearRegression  # a second to import: only fitting needs it

        for _ in range(rounds):
            regressor = LinearRegression(positive=True, fit_intercept=False)
            regressor.fit(X, target, sample_weight=base * robust)
            if self.huber is None:
                break
            residual = np.abs(X @ np.maximum(regressor.coef_, 0.0) - target) / reference
            robust = np.where(residual <= self.huber, 1.0, self.huber / np.maximum(residual, 1e-300))
        self.coef_ = np.maximum(regressor.coef_, 0.0)
        self.regressor_ = regressor
        return self

    def predict(self, variables: Mapping[str, ArrayLike]) -> np.ndarray:
        """Predictions at ``variables`` (non-negative)."""
        X = design_matrix(self.features, {k: np.asarray(v, dtype=float) for k, v in variables.items()})
        return X @ self.coef_

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready parameters and coefficients."""
        return {
            "features": list(self.features),
            "relative": self.relative,
            "huber": self.huber,
            "iterations": self.iterations,
            "coef": [float(c) for c in self.coef_],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MonotoneFit:
        """Inverse of :meth:`to_dict`."""
        fit = cls(
            data["features"],
            relative=bool(data.get("relative", True)),
            huber=data.get("huber"),
            iterations=int(data.get("iterations", 8)),
        )
        coef = np.asarray(data["coef"], dtype=float)
        if coef.shape != (len(fit.features),) or np.any(coef < 0) or not np.all(np.isfinite(coef)):
            raise ValueError(f"coefficients {data['coef']!r} do not fit features {fit.features}")
        fit.coef_ = coef
        return fit
