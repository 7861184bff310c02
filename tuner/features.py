"""Features of a batch of encoded strategies: vectorised, pure array work.

``FeatureTables.from_specs(model, cluster)`` precomputes everything that depends only on the
(model, cluster) pair (bytes per slice, worker counts, bandwidths, ready order, compute time);
``featurize(tables, encoded)`` then turns an ``EncodedStrategies`` batch into a float32 matrix
whose columns are ``FEATURE_NAMES``. Byte counts are per training step.

Traffic accounting (W workers, ``w_n`` on node ``n``, ``Nw`` nodes that have workers):
  * A variable is split along its partition axis into ``k`` contiguous shards (numpy.array_split
    sizes); PS shard ``i`` lives on node ``(dest + i) % N``. The bytes a node hosts are computed
    exactly without a (B, V, N) one-hot: the shards are laid on a line from ``dest`` (three
    difference-array entries per variable, one ``bincount`` per block of strategies, a cumulative
    sum), and the line folds modulo N onto the nodes. Fused all-reduce buffers use the same line
    from the variable's group (strided shards occupy consecutive groups).
  * PS push: every worker sends its gradient to the host (sparse: touched rows x width + int64
    indices); pull: every worker receives the values (sparse: touched rows only). With local
    replication the workers of a node sum a dense variable's gradients, push the sum once per
    node and share one pull (they read it from the local object store); sparse variables push and
    pull per worker because workers touch different rows. Traffic between a worker and a server
    on the same node is intra-node.
  * All-reduce: a ring over all workers; each worker sends and receives ``2(W-1)/W`` x the fused
    buffer. Hierarchical (strategy-wide): the workers of a node reduce onto a leader, the ``Nw``
    leaders run the ring (``2(Nw-1)/Nw`` x the buffer through each NIC, ``2(Nw-1)`` steps), the
    leader broadcasts on the node (two more steps, intra-node bytes).
  * CPU work per node (``cpu_bytes_max``: bytes per core of the busiest node; ``cpu_s`` with the
    default rate): a PS node deserializes and sums the pushes, serializes the pulls and updates
    its parameters (``UPDATE_PASSES`` passes); workers serialize pushes, deserialize pulls, sum
    locally replicated gradients, cast (fp16) or project (PowerSGD) their all-reduced values;
    collectives run on the CPU where a node has no GPU (no NCCL). A node's communication runs on
    as many cores as it has actors (workers + a PS), at most its CPUs. ``ps_calls_max``: the calls
    the busiest PS actor serves one after another (a push and a pull per worker, per node for
    locally replicated variables) — with the per-node bytes, the slowest shard's (straggler's)
    time. ``cpu_contention``: compute runs on the CPUs too (no GPU), so that work hides behind
    nothing. fp16 sends 2 bytes per value; PowerSGD rank ``r`` sends ``r(m+n)`` values per m x n
    shard (never more than the raw ``m n``; vectors are sent raw); sparse gradients are
    all-gathered, ``(W-1)`` x rows x (width + index) per worker, written as an equivalent ring
    buffer of ``W/2`` x the per-worker bytes.
  * Overlap: gradient ``j`` (in ready order) is ready at ``tau_j`` x compute (forward = 1/3 of
    compute, then backward in proportion to parameters); communication is treated as a pipe,
    finishing at ``max_j(tau_j C + T_comm f_j)`` with ``f_j`` the share of wire bytes still to send
    from ``j`` on. ``exposed_frac`` is the part of ``T_comm`` that sticks out past compute.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from strategy_space.encoding import BACKEND_ID, COMPRESSOR_ID, EncodedStrategies

from .alpha_beta import TERMS, AlphaBeta, comm_time, step_time
from .feature_tables import FeatureTables, cpu_ring, curve_ns, powersgd_shard_bytes

FEATURE_NAMES = (
    "compute_s", "num_workers", "num_nodes", "nodes_with_workers", "ps_share", "ps_vars_frac",
    "ps_push_max_node_bytes", "ps_push_sum_bytes", "ps_imbalance", "ps_pull_max_node_bytes",
    "ps_pull_sum_bytes", "ps_nodes_used", "ps_messages", "server_bytes_max", "ps_latency_rounds",
    "lr_saved_bytes", "sparse_ps_bytes", "nic_in_s", "nic_out_s", "intra_s", "wire_s",
    "ar_raw_bytes", "ar_wire_bytes", "ar_ring_bytes", "ar_ring_s", "ar_groups", "ar_collectives",
    "ar_max_group_bytes", "ring_steps", "ring_steps_objectstore", "compressed_saved_bytes",
    "fp16_raw_bytes", "powersgd_raw_bytes", "sparse_allgather_bytes", "staleness", "stale_factor",
    "async", "exposed_frac", "comm_s", "analytic_s", "model_bytes", "ps_calls_max", "cpu_bytes_max",
    "ps_update_bytes_max", "local_agg_bytes", "cpu_contention", "hierarchical", "cpu_s", "ar_curve_s",
)
COL = {n: i for i, n in enumerate(FEATURE_NAMES)}
_CHUNK = 1024              # rows per block: measured flat from 256 to 2048 on a 200-variable model
# a node hosts PS bytes when it holds more than this: an empty node holds rounding noise only (~1e-16
# of the bytes its sums passed through, see tuner.incremental), a shard at least its slices' index
# bytes (>= 8 rows x slices / dim0, i.e. >= 8 / (2 x shards) bytes)
_EMPTY_BYTES = 1e-3
# passes over a parameter's bytes when a parameter server applies its update (gradient, parameter,
# Adam's two moments: read and write); ModelSpec does not name the optimizer, so Adam's
UPDATE_PASSES = 4.0
DEFAULT_PARAMS = AlphaBeta()   # frozen; building one validates it, which costs more than small batches
POWERSGD_ID = COMPRESSOR_ID["powersgd"]


def featurize(t: FeatureTables, enc: EncodedStrategies, params: AlphaBeta | None = None) -> np.ndarray:
    """Feature matrix of a strategy batch.

    Args:
        t: tables of the batch's (model, cluster).
        enc: B encoded strategies over ``t.V`` variables.
        params: alpha-beta parameters for the ``comm_s``/``analytic_s`` columns (default: DESIGN's).

    Returns:
        float32 array (B, len(FEATURE_NAMES)).

    Raises:
        ValueError: the batch has a different number of variables than the tables.
    """
    if enc.kind.shape[1] != t.V:
        raise ValueError(f"strategies encode {enc.kind.shape[1]} variables but the model has {t.V}")
    params = params or DEFAULT_PARAMS
    B = len(enc)
    parts = FeatureSums.empty(B, t)
    # the bincount entries of a block, reused by every block (fresh multi-MB arrays cost page faults)
    n = 3 * min(B, _CHUNK) * t.V
    work = np.empty(n, dtype=np.intp), np.empty(n, dtype=np.float64)
    for s in range(0, B, _CHUNK):
        rows = slice(s, min(s + _CHUNK, B))
        _block_parts(t, enc.take(rows) if B > _CHUNK else enc, parts, rows, work)
    return assemble(t, params, parts)


@dataclass
class FeatureSums:
    """Per-strategy reductions of the (B, V) work, filled block by block; ``assemble`` turns them
    into features for the whole batch at once (its per-node work pays numpy's per-call cost once).
    Laid out strategy-last, so that the assembly's inner loops run over the batch."""

    hosted: np.ndarray   # (3, N, B): PS value bytes hosted per node without / with LR, index bytes
    psum: np.ndarray     # (4 + breakpoints, B): psf @ [sums | ps wire after each breakpoint]
    asum: np.ndarray     # (4, B): arf @ sums
    wsum: np.ndarray     # (breakpoints, B): AR wire bytes at or after each breakpoint (row 0: all)
    scal: np.ndarray     # (8, B): see SCALAR_ROWS

    @classmethod
    def empty(cls, B: int, t: FeatureTables) -> "FeatureSums":
        nbp = t.after.shape[1]
        return cls(np.zeros((3, t.N, B)), np.zeros((4 + nbp, B), np.float32), np.zeros((4, B), np.float32),
                   np.zeros((nbp, B), np.float32), np.zeros((len(SCALAR_ROWS), B), np.float32))


SCALAR_ROWS = {n: i for i, n in enumerate(("fp16_raw", "psgd_raw", "stale", "sync", "objectstore", "n_groups", "n_coll",
                                  "max_group", "hier", "curve_ns", "cpu_ring"))}



def _axis_facts(t: FeatureTables, e: EncodedStrategies):
    """Slices along the partition axis, value/index bytes per slice and values per slice: (V,)
    vectors when every variable is split along axis 0 (the sampler's case), else (B, V)."""
    if not e.axis.any():
        return t.dim0, t.sv0, t.si0, t.cols0
    dim = t.dims[np.arange(t.V), e.axis].astype(np.float32)
    return dim, t.val_bytes / dim, t.idx_bytes / dim, t.size / dim



def _block_parts(t: FeatureTables, e: EncodedStrategies, out: FeatureSums, rows: slice, work) -> None:
    # Budget: ~0.2 ns per element for a float32/int32 (B, V) pass, ~2.5 ns per bincount entry,
    # ~3.5 ns per gathered element. So: no gathers on the common path, no int32 x float32 mixes
    # (they promote to float64), sums over variables as matrix products, one bincount per block.
    B, V, N = len(e), t.V, t.N
    dim, sv, si, cols = _axis_facts(t, e)
    kf = e.shards.astype(np.float32)
    arf = e.kind.astype(np.float32)              # KIND_AR == 1
    psf = 1.0 - arf
    base = np.floor(dim / kf)                    # slices of a base-size shard (exact in float32)
    extra = base * kf
    np.subtract(dim, extra, out=extra)           # that many (the first) shards have one slice more
    comp = e.compressor                          # 0 for PS and sparse variables (normalized)
    is16 = ((comp - 1).view(np.uint32) < 2).astype(np.float32)   # fp16 or fp16_ef
    # all-reduce wire bytes of a whole dense variable (fp16 sends 2 bytes per value)
    wv = arf * t.val_dense
    wv += is16 * t.half_val
    stride = e.group_stride.astype(np.float32)   # 0 unless an AR variable with k > 1 (normalized)
    # Shards laid out on a line from their start (PS: dest node, AR: fusion group): shard i at
    # start + i carries X + Y*[i < e2] bytes up to start + e3 (exclusive); three bincount entries
    # per variable, then a cumulative sum along the line, then PS lines fold modulo N.
    #   PS:           X = base-shard value bytes, Y = one slice, e2 = extra, e3 = k
    #   AR strided:   the same with compressed bytes
    #   AR unstrided: X = wv (the whole variable in one group), Y = 0, e3 = 1
    lay = psf + stride                           # 1 where shards spread over the line
    X = sv * base                                # per-shard value bytes (raw)
    Y = lay * sv                                 # AR unstrided: 0
    shrink = is16 * t.half_m1                    # fp16 strided shards: half the bytes
    shrink += 1.0
    X *= shrink
    Y *= shrink
    fi = np.flatnonzero((comp >= POWERSGD_ID) & t.matrix)
    if len(fi):
        psgd_rows, pv = _row_col(B, V)
        psgd_rows, pv = psgd_rows[fi], pv[fi]     # gathers: cheaper than an int64 division
        # PowerSGD sends r(m + n) values per m x n shard, never more than m n
        r = e.rank.reshape(-1)[fi].astype(np.float32)
        n = cols[pv] if np.ndim(cols) == 1 else cols.reshape(-1)[fi]
        m = base.reshape(-1)[fi]
        eb = t.elem_bytes[pv]
        fb, fe = powersgd_shard_bytes(t, pv, e.axis.reshape(-1)[fi], m, n, r, eb)
        X.reshape(-1)[fi] = fb
        Y.reshape(-1)[fi] = (fe - fb) * lay.reshape(-1)[fi]
        wv.reshape(-1)[fi] = kf.reshape(-1)[fi] * fb + extra.reshape(-1)[fi] * (fe - fb)
    # unstrided AR: X = wv; elsewhere keep X (PS: psf = 1, strided: stride = 1)
    X *= lay
    X += wv * (1.0 - lay)
    if t.sparse_cols.size:
        # sparse gradients under AR are all-gathered, never fused into a group buffer
        c = t.sparse_cols
        X[:, c] *= psf[:, c]
        Y[:, c] *= psf[:, c]

    # ---- one bincount per block: [PS no-LR line | PS LR line | AR lines x {raw, fp16, psgd}] ---
    kmax = int(e.shards.max())
    L = _round_up(N + kmax, N)                   # PS line, a whole number of N-node rounds
    G = int(e.group.max()) + kmax + 1            # AR line: groups, strided shards reach g + k - 1
    BIN = 2 * L + 3 * G
    # class by compressor id: none 0, fp16/fp16_ef 1, powersgd/powersgd_ef 2 (PS: 0)
    off = (comp + 1) >> 1
    off *= G
    off += e.kind * (2 * L)
    off += e.dest
    off += e.group
    off += e.local_replication * (t.dense_i * L)  # dense PS variables with LR: second line
    off += (np.arange(B, dtype=np.int32) * BIN)[:, None]
    nbv = B * V
    idx, wts = work[0][:3 * nbv], work[1][:3 * nbv]
    start = idx[:nbv].reshape(B, V)
    start[:] = off
    e3 = kf - 1.0
    e3 *= lay
    e3 += 1.0
    np.add(off, e3.astype(np.int32), out=idx[nbv:2 * nbv].reshape(B, V))
    e2 = extra * lay
    np.add(off, e2.astype(np.int32), out=idx[2 * nbv:].reshape(B, V))
    # in float64, so that X + Y, -X and -Y cancel exactly past a shard's end (in float32 the sum
    # rounds and an empty node or group would hold ~1e-7 x the variable's bytes)
    np.add(X, Y, out=wts[:nbv].reshape(B, V), dtype=np.float64)
    np.negative(X, out=wts[nbv:2 * nbv].reshape(B, V))
    np.negative(Y, out=wts[2 * nbv:].reshape(B, V))
    flat = np.bincount(idx, wts, minlength=B * BIN).reshape(B, BIN)
    # the cumulative sums along the lines and the fold onto nodes are fixed linear maps of the
    # difference entries: one matrix product each (numpy's cumsum over short rows is slow)
    out.hosted[:2, :, rows] = (flat[:, :2 * L].reshape(B * 2, L) @ _fold(L, N)).reshape(B, 2, N).transpose(1, 2, 0)
    if t.sparse_cols.size:
        out.hosted[2, :, rows] = _sparse_index_hosting(t, e, base, extra, psf, si).T
    groups = (flat[:, 2 * L:].reshape(B * 3, G) @ _fold(G, G)).reshape(B, 3 * G)
    s = out.scal[:, rows].T                      # a view: written in place
    total = groups[:, :G] + groups[:, G:2 * G]
    total += groups[:, 2 * G:]
    # buffers carry whole bytes; an empty one holds rounding noise only
    s[:, SCALAR_ROWS["n_groups"]] = np.count_nonzero(total > 0.5, axis=1)
    s[:, SCALAR_ROWS["n_coll"]] = np.count_nonzero(groups > 0.5, axis=1) + np.count_nonzero(groups[:, 2 * G:] > 0.5, axis=1)
    s[:, SCALAR_ROWS["max_group"]] = total.max(1)
    if t.ar_curve is not None:
        s[:, SCALAR_ROWS["curve_ns"]] = curve_ns(t.ar_curve, total)
    # sums over variables as matrix products, in float64: sums of float32 terms are then exact (bar
    # magnitudes ~2^30 apart), the same in any order (tuner.incremental adds them cell by cell)
    out.psum[:, rows] = (psf.astype(np.float64) @ t.ps_right).T
    out.asum[:, rows] = (arf.astype(np.float64) @ t.sums).T
    out.wsum[:, rows] = (wv.astype(np.float64) @ t.after).T
    s[:, SCALAR_ROWS["fp16_raw"]] = is16.astype(np.float64) @ t.val_bytes
    s[:, SCALAR_ROWS["psgd_raw"]] = np.bincount(psgd_rows, t.val_bytes[pv], minlength=B) if len(fi) else 0.0
    s[:, SCALAR_ROWS["stale"]] = e.staleness.max(1)       # 0 for AR variables (normalized)
    s[:, SCALAR_ROWS["sync"]] = e.sync.astype(np.float32) @ t.ones   # PS variables with sync (AR: 0)
    # one backend per strategy; PS variables encode 0 and objectstore is the largest id
    backend = e.backend.max(1)
    s[:, SCALAR_ROWS["objectstore"]] = backend == BACKEND_ID["objectstore"]
    s[:, SCALAR_ROWS["cpu_ring"]] = cpu_ring(backend)
    s[:, SCALAR_ROWS["hier"]] = e.hierarchical.max(1)     # one hierarchy per strategy (PS variables encode 0)
    if t.sparse_cols.size:
        c = t.sparse_cols                        # all-gathers: one per sparse AR shard
        s[:, SCALAR_ROWS["n_coll"]] += (arf[:, c] * kf[:, c]).sum(1)


def assemble(t: FeatureTables, p: AlphaBeta, a: FeatureSums) -> np.ndarray:
    """Per-node traffic, counts and the analytic estimate of a whole batch from its parts.

    The work is laid out (node, strategy) and (feature, strategy), so that numpy's inner loops run
    over the batch rather than over a handful of nodes or breakpoints (each call of an inner loop
    costs as much as ~20 elements)."""
    N, W, V = t.N, t.W, t.V
    B = a.scal.shape[1]
    f = np.zeros((len(FEATURE_NAMES), B), dtype=np.float32)
    H = a.hosted.astype(np.float32)              # (3, N, B)
    H0, H1 = H[0], H[1]
    P = H0 + H1 + H[2]
    Ptot, H0tot, H1tot = P.sum(0), H0.sum(0), H1.sum(0)
    Q = H0 + H[2]                                # pushed by every worker (no LR: values and indices)
    Qtot = Q.sum(0)
    wk, hw, Nw = t.workers[:, None], t.has_w[:, None], t.Nw
    lr_extra = np.maximum(wk - 1, 0)             # workers of a node beyond the one that pushes its sum
    # local replication: a node's workers sum their gradients, push once per PS node, pull once
    srv_in, srv_out = (W - wk) * Q + (Nw - hw) * H1, (W - wk) * H0 + (Nw - hw) * H1
    cli_out, cli_in = wk * (Qtot - Q) + hw * (H1tot - H1), wk * (H0tot - H0) + hw * (H1tot - H1)
    intra = wk * (Q + H0) + 2 * hw * H1 + 2 * lr_extra * H1tot

    sc = {n: a.scal[i] for n, i in SCALAR_ROWS.items()}
    psum = a.psum[:4]                            # count, sparse bytes, value bytes, dense value bytes
    asum = a.asum
    gather = asum[1]                             # per-worker sparse bytes all-gathered
    wire_dense = a.wsum[0]
    S = wire_dense + gather * (W / 2)            # equivalent ring buffer
    ring = 2 * (W - 1) / W
    hier = sc["hier"] > 0
    # hierarchical: reduce onto a leader per node, ring among the Nw leaders, broadcast on the node
    ring_n = np.where(hier, 2 * (Nw - 1) / Nw, ring)          # NIC share of the buffer per node
    if t.ar_curve is not None:
        nic_ring = 0.0                           # measured: the curve holds the collectives' time
    elif Nw > 1:
        nic_ring = ring_n * S * hw
        intra = intra + S * np.where(hier, 2 * lr_extra, ring * lr_extra)
    else:
        nic_ring = 0.0
        intra = intra + S * np.where(hier, 2 * lr_extra, ring * wk)
    n_coll = sc["n_coll"]
    objectstore = (asum[0] > 0) & (sc["objectstore"] > 0)

    nic_in, nic_out = srv_in + cli_in + nic_ring, srv_out + cli_out + nic_ring
    C = COL
    bw = t.bw[:, None]
    f[C["nic_in_s"]] = (nic_in / bw).max(0)
    f[C["nic_out_s"]] = (nic_out / bw).max(0)
    f[C["intra_s"]] = intra.max(0) / t.intra_bw
    f[C["wire_s"]] = np.maximum(np.maximum(f[C["nic_in_s"]], f[C["nic_out_s"]]), f[C["intra_s"]])
    any_ps = psum[0] > 0
    pushed, pulled = W * Q + Nw * H1, W * H0 + Nw * H1
    f[C["compute_s"]] = t.compute_s
    f[C["model_bytes"]] = t.model_bytes
    f[C["num_workers"]], f[C["num_nodes"]], f[C["nodes_with_workers"]] = W, N, t.Nw
    ps_bytes = Ptot + H0tot + H1tot
    f[C["ps_share"]] = ps_bytes / np.maximum(ps_bytes + ring * S, 1.0)
    f[C["ps_vars_frac"]] = psum[0] / V
    push_max, push_sum = pushed.max(0), pushed.sum(0)
    f[C["ps_push_max_node_bytes"]] = push_max
    f[C["ps_push_sum_bytes"]] = push_sum
    f[C["ps_imbalance"]] = push_max / np.maximum(push_sum / N, 1e-9) * any_ps
    f[C["ps_pull_max_node_bytes"]] = pulled.max(0)
    f[C["ps_pull_sum_bytes"]] = pulled.sum(0)
    used = (P > _EMPTY_BYTES).sum(0)
    f[C["ps_nodes_used"]] = used
    f[C["ps_messages"]] = 2 * W * used
    f[C["server_bytes_max"]] = push_max
    # a worker's push and pull round trips, every PS node at once; on a calibrated cluster each
    # counts as its measured round trip, in units of the default one (``AlphaBeta.alpha_ps_s``)
    rtt = 1.0 if t.ps_round_trip_s is None else t.ps_round_trip_s / DEFAULT_PARAMS.alpha_ps_s
    f[C["ps_latency_rounds"]] = 2 * any_ps * rtt
    f[C["lr_saved_bytes"]] = 2 * H1tot * (W - Nw)
    # ---- CPU work on each node (Ray serialization, sums, optimizer updates, casts, CPU collectives) --
    hosts = P > _EMPTY_BYTES
    # calls a PS node's actor serves one after another: a push and a pull per worker (per node for
    # variables with local replication only)
    calls = 2 * hosts * np.where(Q > _EMPTY_BYTES, W, Nw)
    server = 2 * pushed + pulled + UPDATE_PASSES * (H0 + H1)   # deserialize + sum pushes, serialize pulls
    worker = wk * (Qtot + H0tot) + 2 * hw * H1tot + 2 * lr_extra * H1tot
    worker += wk * (sc["fp16_raw"] + sc["psgd_raw"])           # a cast / projection pass per value
    # collectives on the CPU (no GPU: ring on CPU; hierarchical: the leader sums and broadcasts);
    # a calibrated curve holds that work already
    ar_cpu = S * np.where(hier, 2 * lr_extra + 2 * ring_n * hw, 2 * ring * wk) * (t.ar_curve is None)
    # on the CPU where a node has no GPU, or where the strategy's backend reduces in host memory
    on_cpu = np.maximum(t.cpu_collectives[:, None], sc["cpu_ring"][None, :])
    cpu = (server + worker + ar_cpu * on_cpu) / t.lanes[:, None]
    f[C["ps_calls_max"]] = calls.max(0)
    f[C["cpu_bytes_max"]] = cpu.max(0)
    f[C["ps_update_bytes_max"]] = (UPDATE_PASSES * (H0 + H1)).max(0)
    f[C["local_agg_bytes"]] = (2 * lr_extra * H1tot).max(0) + S * hier * 2 * max(float(t.workers.max()) - 1, 0)
    f[C["cpu_contention"]] = t.cpu_contention
    f[C["hierarchical"]] = hier
    f[C["cpu_s"]] = f[C["cpu_bytes_max"]] / p.cpu_rate_bps + p.alpha_server_s * f[C["ps_calls_max"]]
    f[C["sparse_ps_bytes"]] = psum[1]
    f[C["ar_raw_bytes"]] = asum[2]
    f[C["ar_wire_bytes"]] = S
    f[C["ar_ring_bytes"]] = ring * S
    f[C["ar_ring_s"]] = ring * S / t.ring_bw
    f[C["ar_groups"]] = sc["n_groups"]
    f[C["ar_collectives"]] = n_coll
    f[C["ar_max_group_bytes"]] = sc["max_group"]
    steps = n_coll * np.where(hier, 2 * (Nw - 1) + 2 * (t.workers.max() > 1), 2 * max(W - 1, 0))
    f[C["ring_steps"]] = steps * ~objectstore * (t.ar_curve is None)
    if t.ar_curve is not None:
        # fused buffers and (as one buffer) the all-gathers on the measured curve; hierarchical:
        # the leaders' ring moves ring_n / ring of the flat ring's bytes
        gathered = t.ar_curve.seconds(gather * (W / 2)) if len(t.sparse_cols) else 0.0
        f[C["ar_curve_s"]] = ((sc["curve_ns"].astype(np.float64) * 1e-9 + gathered)
                              * np.where(hier, ring_n / max(ring, 1e-12), 1.0))
    f[C["ring_steps_objectstore"]] = steps * objectstore
    f[C["compressed_saved_bytes"]] = asum[3] - wire_dense
    f[C["fp16_raw_bytes"]] = sc["fp16_raw"]
    f[C["powersgd_raw_bytes"]] = sc["psgd_raw"]
    f[C["sparse_allgather_bytes"]] = gather * max(W - 1, 0)
    stale = sc["stale"]
    asyn = psum[0] > sc["sync"]                  # a PS variable with sync 0
    f[C["staleness"]] = stale
    f[C["stale_factor"]] = np.where(asyn, 0.0, 1.0 / (1.0 + stale))
    f[C["async"]] = asyn

    # ---- overlap with the backward pass (pipe bound at ready-order breakpoints), then estimate --
    terms = {n: f[C[n]] for n in TERMS if n != "exposed_frac"}
    T0 = comm_time(terms, DEFAULT_PARAMS)
    # wire weight per variable, psf * ps_wire + ring * wv, past each breakpoint (sparse AR: below)
    suffix = a.psum[4:] + a.wsum * np.float32(ring)
    if len(t.sparse_cols):
        suffix += t.sparse_after[:, None] * (gather * (W / 2) * ring)
    total = suffix[0]
    x = (T0 / max(t.compute_s, 1e-12)).astype(np.float32)
    suffix *= x / np.maximum(total, 1e-30)
    suffix += t.tau_bp[:, None]
    reach = suffix.max(0)
    exposed = np.clip((reach - 1.0) / np.maximum(x, 1e-12), 0.0, 1.0)
    f[C["exposed_frac"]] = np.where(total > 0, exposed, 0.0)
    terms["exposed_frac"] = f[C["exposed_frac"]]
    f[C["comm_s"]] = comm_time(terms, p)
    f[C["analytic_s"]] = step_time(terms, p)
    return np.ascontiguousarray(f.T)


def _sparse_index_hosting(t: FeatureTables, e: EncodedStrategies, base, extra, psf, si) -> np.ndarray:
    """(B, N) index bytes hosted per node by sparse PS variables (few columns, same line scheme)."""
    c = t.sparse_cols
    B, N = len(e), t.N
    k = e.shards[:, c]
    p = psf[:, c]
    s = si[c] if np.ndim(si) == 1 else si[:, c]
    X = s * base[:, c] * p
    Y = s * p
    L = _round_up(N + int(k.max()), N)
    start = e.dest[:, c] + (np.arange(B, dtype=np.int32) * L)[:, None]
    flat = np.bincount(np.concatenate([start.ravel(), (start + extra[:, c].astype(np.int32)).ravel(), (start + k).ravel()]),
                       np.concatenate([np.add(X, Y, dtype=np.float64).ravel(), -Y.ravel(), -X.ravel()]), minlength=B * L)
    return flat.reshape(B, L) @ _fold(L, N)



def _round_up(x: int, n: int) -> int:
    return -(-x // n) * n


@functools.lru_cache(maxsize=8)
def _row_col(B: int, V: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of every flat index of a (B, V) array."""
    return np.repeat(np.arange(B), V), np.tile(np.arange(V), B)


@functools.lru_cache(maxsize=64)
def _fold(L: int, n: int) -> np.ndarray:
    """(L, n) map from difference entries on a line of length L to the cumulative sums folded
    modulo n: entry p adds to every position q >= p of the line, position q to column q % n."""
    q = np.arange(L)
    return (q[None, :] >= q[:, None]).astype(np.float64) @ (q[:, None] % n == np.arange(n)[None, :]).astype(np.float64)


def terms_of(X: np.ndarray) -> dict:
    """The alpha-beta terms (``alpha_beta.TERMS``) as float64 copies of a feature matrix's columns."""
    return {n: X[:, COL[n]].astype(np.float64) for n in TERMS}
