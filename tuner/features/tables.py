"""Per-(model, cluster) tables the featurizers read: everything about a strategy's cost that does
not depend on the strategy (bytes per slice, worker counts, bandwidths, ready order, compute time).
``FeatureTables.from_specs(model, cluster)`` builds them; ``tuner.features.batch.featurize`` and
``tuner.features.incremental`` read them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strategy_space import ClusterSpec, ModelSpec
from strategy_space.builders import index_bytes, ready_times
from strategy_space.calibration import CostCurve, settled
from strategy_space.compressor import powersgd_wire_values, shard_matrix_dims
from strategy_space.encoding import BACKEND_ID

ESTIMATE_FLOPS = 20e9      # compute estimate when the model has no profile (CPU-class device)
BREAKPOINTS = 24          # ready-order points where the overlap bound is evaluated


def estimate_compute_s(model: ModelSpec) -> float:
    """Compute time per step: the profile's, else ~6 flops per dense parameter per sample (forward
    and backward) plus the touched embedding rows, at ``ESTIMATE_FLOPS``."""
    if model.profile is not None and model.profile.step_time_s > 0:
        return float(model.profile.step_time_s)
    work = 0.0
    for v in model.variables:
        work += 6.0 * ((v.rows_per_step or 1) * v.size // max(1, v.shape[0]) if v.sparse else v.size)
    return work * model.batch_size / ESTIMATE_FLOPS



@dataclass(frozen=True)
class FeatureTables:
    """Per-(model, cluster) constants; build with ``from_specs``. Arrays are indexed by variable
    (V,), node (N,) or (variable, axis)."""

    V: int
    N: int
    W: float
    Nw: float
    workers: np.ndarray     # (N,) workers per node
    has_w: np.ndarray       # (N,) 1.0 where the node has workers
    bw: np.ndarray          # (N,) NIC bytes/s each direction
    intra_bw: float
    dims: np.ndarray        # (V, R) size along each axis (1 past the rank)
    val_bytes: np.ndarray   # (V,) per-worker gradient value bytes per step (sparse: touched rows)
    idx_bytes: np.ndarray   # (V,) index bytes (sparse only)
    elem_bytes: np.ndarray  # (V,) bytes per value
    size: np.ndarray        # (V,) parameters
    sparse: np.ndarray      # (V,) bool
    matrix: np.ndarray      # (V,) bool, rank >= 2 (PowerSGD applies)
    order: np.ndarray       # (V,) variable indices in gradient-ready order
    tau: np.ndarray         # (V,) ready time / compute time, in ready order
    compute_s: float
    model_bytes: float      # per-worker gradient bytes of one step, all variables (normalizer)
    ring_bw: float          # slowest link of the all-reduce ring (bytes/s)
    lanes: np.ndarray       # (N,) cores that work on a node's communication at once (its actors)
    cpu_collectives: np.ndarray   # (N,) 1.0 where collectives run on the CPU (no GPU: no NCCL)
    cpu_contention: float   # 1.0 when compute runs on the CPUs too (no GPU): CPU work cannot hide
    ar_curve: CostCurve | None = None   # the cluster's measured all-reduce seconds per message size
    ps_round_trip_s: float | None = None   # calibrated: the PS data plane's round trip of its smallest message
    held: bool = False      # the model clips by the global norm: synchronous PS steps are held (``ModelSpec``)
    # derived in __post_init__ (float32 so that the per-strategy work stays in float32):
    # dim0, sv0, si0, cols0 (slices, value bytes, index bytes, values per axis-0 slice), dense_i,
    # val_dense, sparse_cols, half_m1 (fp16 bytes / raw - 1), half_val (val_dense x half_m1),
    # sums (V, 4): [1, sparse bytes, value bytes, dense value bytes], ps_right ([sums | PS wire
    # bytes at or after each breakpoint]), ones, after / tau_bp / sparse_after
    # (overlap breakpoints), sparse_whole (table bytes per step byte of the sparse variables)

    def __post_init__(self):
        dim0 = self.dims[:, 0].astype(np.float32)
        dense = (~self.sparse).astype(np.float32)
        sparse_step = (self.val_bytes + self.idx_bytes) * (1.0 - dense)
        # breakpoints in ready order for the overlap bound: after[v, j] = 1 when variable v is
        # ready at or after breakpoint j (at most BREAKPOINTS of them)
        pos = np.empty(self.V, dtype=np.int64)
        pos[self.order] = np.arange(self.V)
        bp = np.unique(np.linspace(0, self.V - 1, min(self.V, BREAKPOINTS)).round().astype(np.int64))
        after = (pos[:, None] >= bp[None, :]).astype(np.float32)
        sums = np.stack([np.ones(self.V), sparse_step, self.val_bytes, self.val_bytes * dense], axis=1).astype(np.float32)
        derived = dict(
            dim0=dim0, sv0=self.val_bytes / dim0, si0=self.idx_bytes / dim0, cols0=self.size / dim0,
            dense_i=(~self.sparse).astype(np.int32),
            val_dense=self.val_bytes * dense, sparse_cols=np.nonzero(self.sparse)[0],
            half_m1=(2.0 / self.elem_bytes - 1.0).astype(np.float32),
            half_val=(self.val_bytes * dense * (2.0 / self.elem_bytes - 1.0)).astype(np.float32),
            ones=np.ones(self.V, np.float32),
            ps_right=np.concatenate([sums, (2 * self.val_bytes + self.idx_bytes)[:, None] * after], axis=1,
                                    dtype=np.float32),
            sums=sums,
            after=after, tau_bp=self.tau[bp],
            sparse_after=sparse_step @ after / max(float(sparse_step.sum()), 1e-30),
            # whole-table bytes per byte a step moves of the tables (a worker updating an
            # all-reduced table updates all of it)
            sparse_whole=float((self.size * self.elem_bytes * (1.0 - dense)).sum() / max(float(sparse_step.sum()), 1e-30)),
        )
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_specs(cls, model: ModelSpec, cluster: ClusterSpec) -> "FeatureTables":
        vs = model.variables
        workers = np.array([n.workers or 0 for n in cluster.nodes], dtype=np.float32)
        R = max(1, max(len(v.shape) for v in vs))
        dims = np.ones((len(vs), R), dtype=np.int32)
        for i, v in enumerate(vs):
            dims[i, :len(v.shape)] = v.shape
        rows = np.array([min(v.rows_per_step or v.shape[0], v.shape[0]) if v.sparse else 0 for v in vs])
        sparse = np.array([v.sparse for v in vs])
        # row ids cross the network as narrow integers, by the table's rows (a shard's may be narrower)
        ids = rows * np.array([index_bytes(v.shape[0]) if v.sparse else 0 for v in vs])
        val = np.array([r * v.row_bytes if v.sparse else v.bytes for r, v in zip(rows, vs)], dtype=np.float64)
        names = [v.name for v in vs]
        ready = model.profile.ready_order if model.profile is not None and model.profile.ready_order else names[::-1]
        order = np.array([model.index(n) for n in ready], dtype=np.int64)
        # backward work per variable ~ its parameters (sparse: touched rows only)
        times = ready_times(model)
        tau = np.array([times[n] for n in ready], dtype=np.float64)
        intra = cluster.intra_node_gbps * 1e9 / 8
        bw = np.array([n.bandwidth_gbps * 1e9 / 8 for n in cluster.nodes], dtype=np.float32)
        multi = (workers > 0).sum() > 1
        cpus = np.array([n.cpus for n in cluster.nodes], dtype=np.float32)
        gpu = np.array([n.gpus > 0 for n in cluster.nodes])
        return cls(
            V=len(vs), N=len(cluster.nodes), W=float(workers.sum()), Nw=float((workers > 0).sum()),
            workers=workers, has_w=(workers > 0).astype(np.float32),
            bw=bw, intra_bw=intra, dims=dims, val_bytes=val.astype(np.float32),
            idx_bytes=ids.astype(np.float32),
            elem_bytes=np.array([v.bytes // v.size for v in vs], dtype=np.float32),
            size=np.array([v.size for v in vs], dtype=np.float32), sparse=sparse,
            matrix=np.array([len(v.shape) >= 2 for v in vs]), order=order,
            # emulated compute waits the profile times the cluster's dilation (``--like --dilation``)
            tau=tau.astype(np.float32), compute_s=estimate_compute_s(model) * cluster.compute_dilation,
            ring_bw=float(bw[workers > 0].min()) if multi else intra,
            model_bytes=float(val.sum() + ids.sum()),
            lanes=np.maximum(1.0, np.minimum(cpus, workers + 1)), cpu_collectives=(~gpu).astype(np.float32),
            # compute on the CPUs competes with synchronization; on GPUs, and with emulated compute
            # (workers sleep), it leaves the CPUs to it
            cpu_contention=float(not gpu[workers > 0].any() and cluster.compute != "emulated"),
            ar_curve=_curve(cluster, float(workers.sum())),
            ps_round_trip_s=float(settled(cluster.calibration.ps_round_trip)[0]) if cluster.calibration is not None else None,
            held=model.global_clipnorm,
        )



def powersgd_shard_bytes(t: FeatureTables, v: np.ndarray, axis: np.ndarray, slices: np.ndarray,
                          cols: np.ndarray, r: np.ndarray, eb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Wire bytes of PowerSGD cells (variable ``v`` split along ``axis``): a base-size shard of
    ``slices`` slices of ``cols`` values, and a shard of one slice more; the matrix is the
    runtime's ``(first dimension, rest)`` of the shard. ``tuner.features.incremental`` calls it too, so the
    two featurizers agree to the bit."""
    first = axis == 0
    dim0 = t.dims[v, 0].astype(np.float32)
    fb = powersgd_wire_values(*shard_matrix_dims(slices, cols, dim0, first), r) * eb
    fe = powersgd_wire_values(*shard_matrix_dims(slices + 1, cols, dim0, first), r) * eb
    return fb, fe



def _curve(cluster: ClusterSpec, W: float) -> CostCurve | None:
    """The cluster's calibrated all-reduce curve, scaled to a ring over all ``W`` workers."""
    cal = cluster.calibration
    if cal is None:
        return None
    ring = lambda n: 2 * (n - 1) / n if n > 1 else 1.0   # noqa: E731 - bytes a ring moves per buffer byte
    return CostCurve(cal.allreduce, scale=ring(W) / ring(cal.workers))


def curve_ns(curve: CostCurve, buffers: np.ndarray) -> np.ndarray:
    """Seconds of a strategy's fused buffers (rows: strategies, columns: groups' bytes) on the
    calibrated curve, in whole nanoseconds per buffer: integer sums are the same in any order, so
    the incremental featurizer's numbers are bit for bit these."""
    return np.rint(curve.seconds(buffers) * 1e9).astype(np.int64).sum(axis=-1).astype(np.float64)


def cpu_ring(backend_max: np.ndarray) -> np.ndarray:
    """Whether a strategy's collectives run on the CPU whatever the nodes hold: ``gloo`` and the
    object store reduce in host memory (a GPU's gradients are copied out and back); ``auto`` and
    ``graph`` use NCCL where the nodes have GPUs. One backend per strategy: its largest id."""
    return (backend_max == BACKEND_ID["gloo"]) | (backend_max == BACKEND_ID["objectstore"])
