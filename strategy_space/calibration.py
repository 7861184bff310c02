"""A cluster's measured communication costs (``autosync calibrate``), stored with its ClusterSpec.

YAML (the ``calibration:`` section of a cluster file; every key required, no others)::

    calibration:
      backend: gloo           # the collective backend measured
      workers: 2              # workers in the measured all-reduce (one per worker slot)
      allreduce:              # median seconds of one all-reduce of a float32 buffer, per size
      - {bytes: 4096, seconds: 0.00031}
      - {bytes: 16384, seconds: 0.00042}
      ps_round_trip:          # median seconds of a push and a pull of the bytes to a PS actor
      - {bytes: 4096, seconds: 0.0011}

Sizes are strictly increasing; seconds finite and > 0. The tuner's analytic model reads the
all-reduce curve per message size (``CostCurve``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .strict import check_keys, get_typed, parse_items
from .errors import ConfigError


def _point(item, where: str) -> tuple[int, float]:
    check_keys(item, where, {"bytes", "seconds"})
    nbytes = get_typed(item, "bytes", int, where)
    seconds = float(get_typed(item, "seconds", (int, float), where))
    if nbytes < 1 or not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"{where}: bytes must be an integer >= 1 and seconds a finite number > 0, "
                          f"got bytes={nbytes!r}, seconds={seconds!r}")
    return nbytes, seconds


def _check_curve(points: tuple, where: str) -> list[str]:
    problems = []
    if not points:
        problems.append(f"{where}: needs at least one {{bytes, seconds}} point")
    sizes = [b for b, _ in points]
    if any(b >= c for b, c in zip(sizes, sizes[1:])):
        problems.append(f"{where}: sizes must be strictly increasing, got {sizes}")
    for b, s in points:
        if not (isinstance(b, int) and not isinstance(b, bool) and b >= 1 and math.isfinite(s) and s > 0):
            problems.append(f"{where}: point ({b!r}, {s!r}) needs bytes >= 1 and finite seconds > 0")
    return problems


@dataclass(frozen=True)
class Calibration:
    """Measured communication costs of a cluster.

    Attributes:
        backend: collective backend the all-reduce curve was measured with.
        workers: workers in the measured all-reduce.
        allreduce: ((bytes, seconds), ...) per message size, sizes increasing.
        ps_round_trip: ((bytes, seconds), ...) of a push and a pull to a PS actor.
    """

    backend: str
    workers: int
    allreduce: tuple
    ps_round_trip: tuple

    def __post_init__(self):
        object.__setattr__(self, "allreduce", tuple((int(b), float(s)) for b, s in self.allreduce))
        object.__setattr__(self, "ps_round_trip", tuple((int(b), float(s)) for b, s in self.ps_round_trip))
        problems = []
        if not (isinstance(self.backend, str) and self.backend):
            problems.append(f"calibration.backend must be a backend name, got {self.backend!r}")
        if not (isinstance(self.workers, int) and not isinstance(self.workers, bool) and self.workers >= 1):
            problems.append(f"calibration.workers must be an integer >= 1, got {self.workers!r}")
        problems += _check_curve(self.allreduce, "calibration.allreduce")
        problems += _check_curve(self.ps_round_trip, "calibration.ps_round_trip")
        if problems:
            raise ConfigError(problems)

    def to_dict(self) -> dict:
        return {"backend": self.backend, "workers": self.workers,
                "allreduce": [{"bytes": b, "seconds": s} for b, s in self.allreduce],
                "ps_round_trip": [{"bytes": b, "seconds": s} for b, s in self.ps_round_trip]}

    @classmethod
    def from_dict(cls, data: Mapping, where: str = "calibration") -> "Calibration":
        check_keys(data, where, {"backend", "workers", "allreduce", "ps_round_trip"})
        return cls(
            backend=get_typed(data, "backend", str, where),
            workers=get_typed(data, "workers", int, where),
            allreduce=tuple(parse_items(get_typed(data, "allreduce", list, where), _point, f"{where}.allreduce")),
            ps_round_trip=tuple(parse_items(get_typed(data, "ps_round_trip", list, where), _point,
                                            f"{where}.ps_round_trip")),
        )


def settled(points) -> np.ndarray:
    """The seconds of measured (bytes, seconds) points, sizes increasing, made non-decreasing in
    size: each size's time is the least measured at that size or any larger one. A smaller message
    never needs longer than a larger one (it could be padded to it), and what disturbs a
    measurement (another process on the cores, a set-up on first use) only adds time, so an
    inversion is a slow measurement of the smaller size. Carrying the slow one upwards instead
    (a running maximum) would charge every size up to the next slower one with it: one
    ``autosync calibrate`` on ``local`` (2026-12-02) measured 3.9 ms at 4 KiB and 0.26 ms at
    16 KiB (0.32 ms at 4 KiB when run again), which put every all-reduce up to 4 MiB at 3.9 ms."""
    s = np.array([p[1] for p in points], dtype=np.float64)
    return np.minimum.accumulate(s[::-1])[::-1]


class CostCurve:
    """Seconds of one message of a given size from measured (bytes, seconds) points (made
    non-decreasing in size by ``settled``): log-log interpolation between them, the smallest size's
    time below it (latency bound), and the last segment's bandwidth beyond the largest (bandwidth
    bound).

    Args:
        points: ((bytes, seconds), ...), sizes increasing.
        scale: factor on every time (e.g. a ring over more workers than were measured).
    """

    def __init__(self, points, scale: float = 1.0):
        b = np.array([p[0] for p in points], dtype=np.float64)
        s = settled(points) * scale
        self.log_b, self.log_s = np.log(b), np.log(s)
        self.b_last, self.s_last = b[-1], s[-1]
        # bytes per second of the last segment (at least the last point's average rate)
        rate = b[-1] / s[-1]
        if len(b) > 1 and s[-1] > s[-2]:
            rate = max(rate, (b[-1] - b[-2]) / (s[-1] - s[-2]))
        self.rate = rate

    def seconds(self, nbytes: np.ndarray) -> np.ndarray:
        """Seconds per message of each size (0 for empty messages)."""
        m = np.asarray(nbytes, dtype=np.float64)
        inside = np.exp(np.interp(np.log(np.maximum(m, 1.0)), self.log_b, self.log_s))
        beyond = self.s_last + (m - self.b_last) / self.rate
        return np.where(m > 0.5, np.where(m > self.b_last, beyond, inside), 0.0)
