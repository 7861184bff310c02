"""Loss-curve arithmetic of an efficiency probe (``goodput.estimate_efficiency``): trailing means,
one batch's noise, the non-increasing trend of a curve and the step at which it reaches a level."""
from __future__ import annotations

import math

import numpy as np


def smooth(losses: np.ndarray, window: int) -> np.ndarray:
    """Trailing means: entry i is the mean of ``losses[i - window + 1 : i + 1]`` (i >= window - 1;
    the array starts at that index)."""
    c = np.cumsum(np.concatenate([[0.0], losses]))
    return (c[window:] - c[:-window]) / window


def batch_noise(losses: np.ndarray) -> float:
    """Standard deviation of one batch's loss around the trend: from the differences of
    neighbouring steps (a slow trend cancels in them), robustly (median absolute deviation)."""
    d = np.diff(losses)
    if len(d) < 2:
        return 0.0
    mad = float(np.median(np.abs(d - np.median(d))))
    return 1.4826 * mad / math.sqrt(2.0)


def decreasing_fit(y: np.ndarray) -> np.ndarray:
    """The least-squares non-increasing fit of ``y`` (isotonic regression by pooling adjacent
    violators): a loss curve's trend without the downward bias a running minimum of its noise has."""
    values: list[float] = []
    weights: list[float] = []
    lengths: list[int] = []
    for v in np.asarray(y, dtype=np.float64):
        values.append(float(v))
        weights.append(1.0)
        lengths.append(1)
        while len(values) > 1 and values[-2] < values[-1]:
            v2, w2, n2 = values.pop(), weights.pop(), lengths.pop()
            values[-1] = (values[-1] * weights[-1] + v2 * w2) / (weights[-1] + w2)
            weights[-1] += w2
            lengths[-1] += n2
    return np.repeat(values, lengths)


def steps_to_reach(fit: np.ndarray, level: float, window: int) -> float:
    """The step (fractional, 1-based) at which the non-increasing window-mean curve ``fit`` first
    falls to ``level``, interpolated between steps; ``inf`` if it never does. A window mean stands
    for the step at its centre: entry i for step ``i + (window + 1) / 2``."""
    hit = np.nonzero(fit <= level)[0]
    if not len(hit):
        return float("inf")
    i = int(hit[0])
    centre = (window + 1) / 2
    if i == 0:
        return centre
    hi, lo = fit[i - 1], fit[i]
    frac = (hi - level) / (hi - lo) if hi > lo else 1.0
    return float(i - 1 + frac + centre)
