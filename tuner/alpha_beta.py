"""The alpha-beta formula of one synchronous training step, over physical terms.

The terms (seconds at nominal bandwidth, message counts, overlap fraction) come from
``tuner.features``; this module only combines them, so the parameters can be refitted on measured
trials without recomputing any per-variable array (see ``tuner.cost_model``).

Step model::

    T_comm  = wire_s / efficiency                       # busiest NIC (in or out) or intra-node bus
            + server_bytes_max / server_rate            # PS aggregation on the busiest server (fan-in)
            + alpha_call * ps_latency_rounds            # push + pull round trips + serialized fan-in calls
            + alpha_step * ring_steps                   # 2(W-1) steps per collective (gloo)
            + alpha_call * ring_steps_objectstore       # ... a Ray call per step on the object-store backend
    exposed = T_comm * exposed_frac * (1 - ps_share * (1 - stale_factor))
    step    = max(compute_scale * compute_s + exposed, T_comm)

``exposed_frac`` is the share of the communication that cannot hide behind the backward pass in
gradient-ready order (computed once with the default parameters, see ``features``); staleness ``s``
lets parameter-server traffic hide behind the next step's compute (``stale_factor = 1/(1+s)``,
0 when asynchronous). The ``max(.., T_comm)`` is the throughput bound: however well it overlaps, a
step cannot be shorter than the time the network is busy.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Mapping

import numpy as np

# terms the formula reads; features.py produces every one of them
TERMS = ("compute_s", "wire_s", "server_bytes_max", "ps_latency_rounds", "ring_steps",
         "ring_steps_objectstore", "exposed_frac", "ps_share", "stale_factor")


@dataclass(frozen=True)
class AlphaBeta:
    """Parameters of the step formula (module doc). Defaults come from DESIGN.md section 5.

    Attributes:
        alpha_call_s: one Ray actor call round trip (~0.7 ms measured).
        alpha_step_s: one step of a ring collective on a real collective backend.
        efficiency: fraction of the nominal NIC bandwidth achieved (961/1000 Mbit/s measured,
            lower with serialization).
        server_rate_bps: bytes per second a parameter server aggregates (CPU adds).
        compute_scale: multiplier on the profiled compute time (profiling vs training drift).
    """

    alpha_call_s: float = 0.7e-3
    alpha_step_s: float = 0.1e-3
    efficiency: float = 0.9
    server_rate_bps: float = 4e9
    compute_scale: float = 1.0

    def __post_init__(self):
        bad = {k: v for k, v in asdict(self).items() if not (np.isfinite(v) and v > 0)}
        if bad:
            raise ValueError(f"AlphaBeta parameters must be finite and > 0, got {bad}")

    def to_vector(self) -> np.ndarray:
        return np.log(np.array([getattr(self, f.name) for f in fields(self)], dtype=np.float64))

    @classmethod
    def from_vector(cls, theta: np.ndarray) -> "AlphaBeta":
        return cls(*(float(x) for x in np.exp(theta)))


def comm_time(terms: Mapping[str, np.ndarray], p: AlphaBeta) -> np.ndarray:
    """``T_comm`` of the module doc, per strategy (seconds)."""
    return (terms["wire_s"] / p.efficiency
            + terms["server_bytes_max"] / p.server_rate_bps
            + p.alpha_call_s * (terms["ps_latency_rounds"] + terms["ring_steps_objectstore"])
            + p.alpha_step_s * terms["ring_steps"])


def step_time(terms: Mapping[str, np.ndarray], p: AlphaBeta) -> np.ndarray:
    """Predicted seconds per synchronous step, per strategy.

    Args:
        terms: arrays named as in ``TERMS`` (all the same length).
        p: parameters.

    Returns:
        float array of step times.
    """
    t = comm_time(terms, p)
    hide = 1.0 - terms["ps_share"] * (1.0 - terms["stale_factor"])
    exposed = t * terms["exposed_frac"] * hide
    return np.maximum(p.compute_scale * terms["compute_s"] + exposed, t)
