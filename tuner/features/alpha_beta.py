"""The alpha-beta formula of one synchronous training step, over physical terms.

The terms (seconds at nominal bandwidth, bytes, message counts, overlap fraction) come from
``tuner.features.batch``; this module only combines them, so the parameters can be refitted on measured
trials without recomputing any per-variable array (see ``tuner.cost_models.analytic``).

Step model::

    T_net   = wire_s / efficiency                       # busiest NIC (in or out) or intra-node bus
            + alpha_ps * ps_latency_rounds              # a worker's push and pull round trips
            + alpha_step * ring_steps                   # steps of the collectives on CPU rings (gloo)
            + alpha_nccl_step * nccl_ring_steps         # ... and on NCCL, where every node has GPUs
            + alpha_call * ring_steps_objectstore       # ... a Ray call per step on the object-store backend
            + ar_curve_s                                # calibrated clusters: the collectives on the
                                                        # measured curve (wire and steps then exclude them)
    T_cpu   = cpu_bytes_max / cpu_rate                  # busiest node's CPU bytes per core: Ray
                                                        # serialization, PS sums and optimizer updates,
                                                        # casts, collectives on the CPU
            + alpha_server * ps_calls_max               # calls the busiest PS actor serves in turn
            + alpha_matrix * psgd_matrices              # PowerSGD's fixed work per matrix and step
    T_comm  = T_net + T_cpu
    exposed = (T_net + (1 - cpu_contention) T_cpu) * exposed_frac * (1 - ps_share * (1 - stale_factor))
            + cpu_contention * T_cpu
    step    = max(compute_scale * compute_s + exposed, T_comm)

``exposed_frac`` is the share of the communication that cannot hide behind the backward pass in
gradient-ready order (computed once with the default parameters, see ``features``); staleness ``s``
lets parameter-server traffic hide behind the next step's compute (``stale_factor = 1/(1+s)``)
where the runtime pulls the next step's values ahead: every variable on a synchronous PS with
``s >= 1``; with an all-reduced variable, or asynchronous, ``stale_factor`` is 1 (the pull stays
in the step). Where compute runs on the CPUs (``cpu_contention`` 1: no GPU), the
communication's CPU work competes with it and hides behind nothing. The ``max(.., T_comm)`` is the
throughput bound: however well it overlaps, a step cannot be shorter than the time the network and
the CPUs are busy.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Mapping

import numpy as np

# terms the formula reads; features/batch.py produces every one of them
TERMS = ("compute_s", "wire_s", "ps_latency_rounds", "ring_steps", "ring_steps_objectstore", "exposed_frac",
         "ps_share", "stale_factor", "cpu_bytes_max", "ps_calls_max", "cpu_contention", "ar_curve_s",
         "psgd_matrices", "nccl_ring_steps")


@dataclass(frozen=True)
class AlphaBeta:
    """Parameters of the step formula (module doc): physical constants, not fitted to any benchmark.

    Attributes:
        alpha_call_s: one Ray actor call round trip (~0.7-1.0 ms measured on this project's
            machines; the object-store collective backend makes one per ring step).
        alpha_ps_s: one request's round trip on the parameter servers' data plane (ZeroMQ, 0.2 ms
            between two testbed nodes: ``benchmarks/results/ps_transport.json``).
        alpha_step_s: one step of a ring collective on a real collective backend (~0.1 ms: a TCP
            round trip plus a kernel launch).
        efficiency: fraction of the nominal NIC bandwidth achieved (961/1000 Mbit/s measured, lower
            with protocol overheads).
        cpu_rate_bps: bytes per second one core serializes, copies or adds (memory-bound numpy and
            pickle: a few GB/s).
        alpha_server_s: CPU time an actor spends on one method call (Ray task dispatch and
            argument handling, part of the round trip).
        compute_scale: multiplier on the profiled compute time (profiling vs training drift).
        alpha_nccl_step_s: one step of an NCCL ring between GPUs: 9.6 us over the network and 3.4-5.7 us
            within a node (NVLink, PCIe) in NCCL's own latency model (``hwLat``, Ring/Simple, in
            NCCL's src/graph/tuning.cc); 10 us. A CPU ring's step (``alpha_step_s``) is a TCP round
            trip on the host, ten times that: on 1,024 GPUs a collective of 2(W - 1) steps costs
            20 ms at NCCL's and 0.2 s at a CPU ring's.
        alpha_matrix_s: a worker's fixed time per PowerSGD matrix and step, whatever its size
            (its projections, orthogonalization, error feedback and reshapes run as a dozen small
            kernels; on this project's CPU testbed PowerSGD strategies ran ~1 ms per compressed
            matrix slower than their bytes explain, from 8 to 43 matrices).
    """

    alpha_call_s: float = 0.7e-3
    alpha_step_s: float = 0.1e-3
    efficiency: float = 0.9
    cpu_rate_bps: float = 2.5e9
    alpha_server_s: float = 0.2e-3
    compute_scale: float = 1.0
    alpha_ps_s: float = 0.2e-3
    alpha_matrix_s: float = 1e-3
    alpha_nccl_step_s: float = 10e-6

    def __post_init__(self):
        bad = {k: v for k, v in asdict(self).items() if not (np.isfinite(v) and v > 0)}
        if bad:
            raise ValueError(f"AlphaBeta parameters must be finite and > 0, got {bad}")

    def to_vector(self) -> np.ndarray:
        return np.log(np.array([getattr(self, f.name) for f in fields(self)], dtype=np.float64))

    @classmethod
    def from_vector(cls, theta: np.ndarray) -> "AlphaBeta":
        return cls(*(float(x) for x in np.exp(theta)))


def net_time(terms: Mapping[str, np.ndarray], p: AlphaBeta) -> np.ndarray:
    """``T_net`` of the module doc, per strategy (seconds)."""
    return (terms["wire_s"] / p.efficiency
            + p.alpha_ps_s * terms["ps_latency_rounds"] + p.alpha_call_s * terms["ring_steps_objectstore"]
            + p.alpha_step_s * terms["ring_steps"] + p.alpha_nccl_step_s * terms["nccl_ring_steps"]
            + terms["ar_curve_s"])


def cpu_time(terms: Mapping[str, np.ndarray], p: AlphaBeta) -> np.ndarray:
    """``T_cpu`` of the module doc, per strategy (seconds)."""
    return (terms["cpu_bytes_max"] / p.cpu_rate_bps + p.alpha_server_s * terms["ps_calls_max"]
            + p.alpha_matrix_s * terms["psgd_matrices"])


def comm_time(terms: Mapping[str, np.ndarray], p: AlphaBeta) -> np.ndarray:
    """``T_comm`` of the module doc, per strategy (seconds)."""
    return net_time(terms, p) + cpu_time(terms, p)


def step_time(terms: Mapping[str, np.ndarray], p: AlphaBeta) -> np.ndarray:
    """Predicted seconds per synchronous step, per strategy.

    Args:
        terms: arrays named as in ``TERMS`` (all the same length).
        p: parameters.

    Returns:
        float array of step times.
    """
    net, cpu = net_time(terms, p), cpu_time(terms, p)
    hide = 1.0 - terms["ps_share"] * (1.0 - terms["stale_factor"])
    shared = terms["cpu_contention"]
    exposed = (net + (1.0 - shared) * cpu) * terms["exposed_frac"] * hide + shared * cpu
    return np.maximum(p.compute_scale * terms["compute_s"] + exposed, net + cpu)
