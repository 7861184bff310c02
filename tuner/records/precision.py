"""How precisely a trial's median step time is known, and when a trial has measured enough.

The interval is distribution-free: for ``n`` step times sorted ascending, the true median lies
between the ``j``-th and the ``k``-th with probability ``P(j <= B < k)``, ``B ~ Binomial(n, 1/2)``,
whatever the step-time distribution (steps must be independent draws; steps of one trial are
close enough to that once warm-up is over). With fewer than 6 steps no pair of order statistics
covers the median with 95 % probability, so there is no interval.

``MeasurePolicy`` is the stopping rule the runner follows: after warm-up, run a first batch of
steps, then more until the interval's half-width is within ``precision`` of the median or a cap
(steps, seconds) is reached. Checking the interval after each batch makes the coverage a little
lower than nominal (repeated looks); batches grow geometrically so there are few looks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

MIN_STEPS_95 = 6


@lru_cache(maxsize=4096)
def order_statistic_ranks(n: int, confidence: float = 0.95) -> tuple[int, int] | None:
    """0-based ranks ``(j, k)`` of the narrowest symmetric pair of order statistics of ``n``
    samples that covers the median with probability >= ``confidence``; None if none does.

    Raises:
        ValueError: ``confidence`` outside (0, 1) or ``n`` < 0.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n!r}")
    if n == 0:
        return None
    total = 2 ** n
    # tail[i] = P(B <= i); coverage of (x_(j), x_(n-1-j)) (0-based) = 1 - 2 P(B <= j)
    tail, best = 0, None
    for j in range(n // 2 + 1):
        tail += math.comb(n, j)
        if 1 - 2 * tail / total >= confidence:
            best = j
        else:
            break
    return None if best is None else (best, n - 1 - best)


def median_interval(samples: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free ``confidence`` interval ``(lo, hi)`` of the median of ``samples``, or None
    when there are too few samples (fewer than 6 at 95 %)."""
    x = np.sort(np.asarray(samples, dtype=float))
    ranks = order_statistic_ranks(len(x), confidence)
    if ranks is None:
        return None
    return float(x[ranks[0]]), float(x[ranks[1]])


def relative_halfwidth(samples: Sequence[float], confidence: float = 0.95) -> float:
    """The interval's larger distance from the median, as a fraction of the median (inf when there
    is no interval or the median is not positive)."""
    ci = median_interval(samples, confidence)
    med = float(np.median(samples)) if len(samples) else 0.0
    if ci is None or not med > 0:
        return math.inf
    return max(med - ci[0], ci[1] - med) / med


@dataclass(frozen=True)
class MeasurePolicy:
    """When a trial has measured enough (see the module doc).

    Attributes:
        precision: target half-width of the median's interval, as a fraction of the median (0.03
            is +-3 %); None measures exactly ``min_steps`` steps (the old fixed-count behaviour).
        confidence: of the interval.
        min_steps: timed steps of the first batch (at least 6 for a 95 % interval to exist).
        max_steps: never more timed steps than this.
        max_seconds: never start a batch expected to end later than this many seconds after the
            timed steps began.
    """

    precision: float | None = 0.03
    confidence: float = 0.95
    min_steps: int = 10
    max_steps: int = 200
    max_seconds: float = 60.0

    def __post_init__(self):
        problems = []
        if self.precision is not None and not (isinstance(self.precision, (int, float)) and 0 < self.precision < 1):
            problems.append(f"precision must be a fraction in (0, 1) such as 0.03, or None, got {self.precision!r}")
        if not (isinstance(self.min_steps, int) and self.min_steps >= 1):
            problems.append(f"min_steps must be an integer >= 1, got {self.min_steps!r}")
        if not (isinstance(self.max_steps, int) and self.max_steps >= 1):
            problems.append(f"max_steps must be an integer >= 1, got {self.max_steps!r}")
        elif isinstance(self.min_steps, int) and self.max_steps < self.min_steps:
            problems.append(f"max_steps ({self.max_steps}) must be >= min_steps ({self.min_steps})")
        if not (isinstance(self.max_seconds, (int, float)) and self.max_seconds > 0):
            problems.append(f"max_seconds must be > 0, got {self.max_seconds!r}")
        if not 0 < self.confidence < 1:
            problems.append(f"confidence must be in (0, 1), got {self.confidence!r}")
        if problems:
            raise ValueError("; ".join(problems))

    def next_batch(self, step_times: Sequence[float], elapsed_s: float) -> int:
        """How many more timed steps to run after ``step_times`` (taken in ``elapsed_s`` seconds);
        0 when the interval is precise enough or a cap would be passed."""
        n = len(step_times)
        if n < self.min_steps:
            return self.min_steps - n
        if self.precision is None or self.reached(step_times):
            return 0
        room = self.max_steps - n
        per_step = elapsed_s / n if n else 0.0
        if per_step > 0:
            room = min(room, int((self.max_seconds - elapsed_s) / per_step))
        # grow by half of what was measured: few looks at the interval, little overshoot
        return max(0, min(room, max(MIN_STEPS_95, n // 2)))

    def reached(self, step_times: Sequence[float]) -> bool:
        """Whether the median's interval is within ``precision`` (always true without a target)."""
        return self.precision is None or relative_halfwidth(step_times, self.confidence) <= self.precision

    def describe(self, step_times: Sequence[float]) -> dict:
        """What a Trial's ``meta['measure']`` records: target, interval, half-width, whether reached."""
        ci = median_interval(step_times, self.confidence)
        return {"precision": self.precision, "confidence": self.confidence, "steps": len(step_times),
                "ci": list(ci) if ci else None,
                "halfwidth": relative_halfwidth(step_times, self.confidence) if ci else None,
                "reached": bool(self.reached(step_times)) if self.precision is not None else None}
