"""Errors shared by the tuner's estimators."""
from __future__ import annotations


class NotFittedError(RuntimeError):
    """An estimator was used before ``fit`` (scikit-learn's convention, without importing it)."""


def check_fitted(estimator, attribute: str) -> None:
    """Raise NotFittedError unless ``estimator`` has the fitted ``attribute`` (ends in ``_``).

    Raises:
        NotFittedError: naming the estimator and what to call first.
    """
    if getattr(estimator, attribute, None) is None:
        raise NotFittedError(f"this {type(estimator).__name__} is not fitted yet; call fit(...) with "
                             f"training data before using it")
