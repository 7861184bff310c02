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
    locally replicated gradients, cast (fp16) or project (PowerSGD) their all-reduced values,
    and, where they compute on the CPUs (no GPU, real compute), update their own copy of every
    all-reduced variable (``UPDATE_PASSES`` over its whole bytes, a table's too: Keras' Adam
    decays both moments on every row: ``benchmarks/results/simulator_accuracy_builtin.json`` and
    ``analytic_by_builder_builtin.json`` say what counting it changed);
    collectives run on the CPU where a node has no GPU (no NCCL). A node's communication runs on
    as many cores as it has actors (workers + a PS), at most its CPUs. ``ps_calls_max``: the calls
    the busiest PS actor serves one after another (a push and a pull per worker, per node for
    locally replicated variables) — with the per-node bytes, the slowest shard's (straggler's)
    time. ``cpu_contention``: compute runs on the CPUs too (no GPU), so that work hides behind
    nothing. fp16 sends 2 bytes per value; PowerSGD rank ``r`` sends ``r(m+n)`` values per m x n
    shard (never more than the raw ``m n``; vectors are sent raw); sparse gradients are
    all-gathered, ``(W-1)`` x rows x (width + index) per worker, written as an equivalent ring
    buffer of ``W/2`` x the per-worker bytes.
  * Phases of a synchronous PS step: no shard (chunk) is updated before every push of it is in,
    so the step's pulls follow its pushes: wire time at least the longer phase (the pushes, with
    the collectives, or the pulls, each at its busiest NIC) plus the shorter one over the chunks
    the runtime pipelines them in (``_pipeline_chunks``). Held steps (``ModelSpec.global_clipnorm``)
    pipeline nothing, and the norm's parts and the scale add one round trip (``ps_latency_rounds``).
  * Overlap: gradient ``j`` (in ready order) is ready at ``tau_j`` x compute (forward = 1/3 of
    compute, then backward in proportion to parameters); communication is treated as a pipe,
    finishing at ``max_j(tau_j C + T_comm f_j)`` with ``f_j`` the share of wire bytes still to send
    from ``j`` on. ``exposed_frac`` is the part of ``T_comm`` that sticks out past compute.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strategy_space.encoding import EncodedStrategies

from tuner.features.alpha_beta import TERMS, AlphaBeta, comm_time, cpu_time, step_time
from tuner.features.sums import SCALAR_ROWS, FeatureSums, block_sums
from tuner.features.tables import FeatureTables

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
    "psgd_matrices", "nccl_ring_steps",
)
COL = {n: i for i, n in enumerate(FEATURE_NAMES)}
_CHUNK = 1024              # rows per block: measured flat from 256 to 2048 on a 200-variable model
# the memory a block's arrays may take: a block has fewer rows than _CHUNK only where its shard
# lines run to a million entries and more (thousands of workers, shards and fusion groups)
_BLOCK_BYTES = 256 * 2**20
# a node hosts PS bytes when it holds more than this: an empty node holds rounding noise only (~1e-16
# of the bytes its sums passed through, see tuner.features.incremental), a shard at least its slices' index
# bytes (>= 8 rows x slices / dim0, i.e. >= 8 / (2 x shards) bytes)
_EMPTY_BYTES = 1e-3
# passes over a parameter's bytes when a parameter server applies its update (gradient, parameter,
# Adam's two moments: read and write); ModelSpec does not name the optimizer, so Adam's
UPDATE_PASSES = 4.0
# the runtime's PS pipelining (``autosync.runtime.engine``, ``autosync.runtime.sync.ps``): a test
# holds these equal to the runtime's
PS_CHUNKS, PS_CHUNK_MIN_BYTES, SPARSE_CHUNK_MIN_S = 4, 1 << 20, 1e-3
DEFAULT_PARAMS = AlphaBeta()   # frozen; building one validates it, which costs more than small batches


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
    chunk = block_rows(t, enc)
    # the bincount entries of a block, reused by every block (fresh multi-MB arrays cost page faults)
    n = 3 * min(B, chunk) * t.V
    work = np.empty(n, dtype=np.intp), np.empty(n, dtype=np.float64)
    for s in range(0, B, chunk):
        rows = slice(s, min(s + chunk, B))
        block_sums(t, enc.take(rows) if B > chunk else enc, parts, rows, work)
    return assemble(t, params, parts)


def block_rows(t: FeatureTables, enc: EncodedStrategies) -> int:
    """Rows per block of ``featurize``: _CHUNK, or fewer where one row's arrays are large (its
    bincount lines of ``2 L + 3 G`` float64 entries and their folds, ``features.sums``; a few
    dozen float64 arrays of one entry per variable), so that a block takes about _BLOCK_BYTES."""
    if not len(enc):
        return _CHUNK
    kmax = int(enc.shards.max())
    line = 2 * (2 * t.N + kmax) + 3 * (int(enc.group.max()) + kmax + 1)   # L rounded up to N nodes at most
    return int(np.clip(_BLOCK_BYTES // (8 * (3 * line + 32 * t.V)), 1, _CHUNK))


def assemble(t: FeatureTables, p: AlphaBeta, a: FeatureSums) -> np.ndarray:
    """Per-node traffic, counts and the analytic estimate of a whole batch from its parts.

    The work is laid out (node, strategy) and (feature, strategy), so that numpy's inner loops run
    over the batch rather than over a handful of nodes or breakpoints (each call of an inner loop
    costs as much as ~20 elements)."""
    f = np.zeros((len(FEATURE_NAMES), a.scal.shape[1]), dtype=np.float32)
    scalars = {n: a.scal[i] for n, i in SCALAR_ROWS.items()}
    ps = _PsNodes.of(t, a.hosted)
    ring = _Ring.of(t, a, scalars)
    sync_ps = scalars["sync"] > 0
    # global clipping holds the step of every strategy with a synchronous PS variable (``ps_clip``)
    held = sync_ps if t.held else None
    _traffic_columns(f, t, ps, ring, sync_ps, _pipeline_chunks(t, a, ps, held))
    _ps_columns(f, t, a, ps, ring, held)
    _cpu_columns(f, t, p, ps, ring, scalars, a.asum[3] + a.asum[1] * t.sparse_whole)
    _allreduce_columns(f, t, a, ring, scalars)
    _overlap_columns(f, t, p, a, ring)
    return np.ascontiguousarray(f.T)


@dataclass
class _PsNodes:
    """Parameter-server bytes per node, laid out (node, strategy), float32; ``*_total``: summed over
    the nodes (strategy,)."""

    values: np.ndarray      # H0: value bytes hosted of variables without local replication
    lr_values: np.ndarray   # H1: value bytes hosted of variables with local replication
    hosted: np.ndarray      # P: every PS byte hosted (values, LR values, sparse indices)
    pushed_each: np.ndarray  # Q: pushed by every worker (no LR: values and indices)
    pushed: np.ndarray      # what reaches the node per step: every worker's push, one per node with LR
    pulled: np.ndarray      # what leaves it: every worker's pull, one per node with LR
    values_total: np.ndarray
    lr_total: np.ndarray
    hosted_total: np.ndarray
    pushed_each_total: np.ndarray

    @classmethod
    def of(cls, t: FeatureTables, hosted: np.ndarray) -> "_PsNodes":
        H = hosted.astype(np.float32)              # (3, N, B)
        H0, H1 = H[0], H[1]
        P = H0 + H1 + H[2]
        Q = H0 + H[2]
        W, Nw = t.W, t.Nw
        return cls(H0, H1, P, Q, W * Q + Nw * H1, W * H0 + Nw * H1, H0.sum(0), H1.sum(0), P.sum(0), Q.sum(0))


@dataclass
class _Ring:
    """The all-reduce ring of a batch: its equivalent buffer and each worker's share of it."""

    gather: np.ndarray      # per-worker sparse bytes all-gathered
    wire_dense: np.ndarray  # fused dense buffers' wire bytes
    buffer: np.ndarray      # S: the equivalent ring buffer (all-gathers as W/2 x their bytes)
    share: float            # 2 (W - 1) / W: bytes each worker sends and receives per buffer byte
    hier: np.ndarray        # hierarchical strategies
    nic_share: np.ndarray   # the NIC share of the buffer per node (hierarchical: the leaders' ring)

    @classmethod
    def of(cls, t: FeatureTables, a: FeatureSums, scalars: dict) -> "_Ring":
        W, Nw = t.W, t.Nw
        gather, wire_dense = a.asum[1], a.wsum[0]
        ring = 2 * (W - 1) / W
        hier = scalars["hier"] > 0
        # hierarchical: reduce onto a leader per node, ring among the Nw leaders, broadcast on the node
        ring_n = np.where(hier, 2 * (Nw - 1) / Nw, ring)
        return cls(gather, wire_dense, wire_dense + gather * (W / 2), ring, hier, ring_n)


def _pipeline_chunks(t: FeatureTables, a: FeatureSums, ps: _PsNodes, held: np.ndarray | None) -> np.ndarray:
    """Chunks a synchronous PS step's pushes and pulls pipeline in, per strategy, as the runtime
    cuts them (``autosync.runtime.engine``): up to 4 per actor where it holds 2 MiB or more of
    dense bytes (one per MiB), and an actor's sparse tables apart where it serves a worker on
    another node, its node's link would carry a step's pushes and then its pulls (it is the only
    PS node, or its node runs no worker: ``sync.ps.pipelined_sparse``), and a step's rows take a
    millisecond or more on the slowest link; 1 (no overlap) for a held step."""
    hosts = ps.hosted > _EMPTY_BYTES
    used = np.maximum(hosts.sum(0), 1)
    dense = np.floor(a.psum[3] / used / PS_CHUNK_MIN_BYTES)
    k = np.where(dense >= 2, np.minimum(dense, PS_CHUNKS), 1.0)
    tables = float(t.sparse.sum())
    if tables >= 2:
        with_w = t.has_w[:, None] > 0
        remote = (t.Nw - with_w) > 0            # a worker on a node other than this one
        cut = (hosts & remote & ((used == 1) | ~with_w)).any(0)
        rows = cut & (a.psum[1] >= float(t.bw.min()) * SPARSE_CHUNK_MIN_S)
        k = np.where(rows, np.maximum(k, min(tables, PS_CHUNKS - 1)), k)
    return np.where(held, 1.0, k) if held is not None else k


def _traffic_columns(f: np.ndarray, t: FeatureTables, ps: _PsNodes, ring: _Ring, sync_ps: np.ndarray,
                     chunks: np.ndarray) -> None:
    """Seconds on the busiest NIC (in, out) and intra-node link, and the wire time. A synchronous
    PS updates nothing before all of a step's pushes (of a chunk) are in, so its pulls follow its
    pushes: the wire time is at least the push phase (with the collectives) and the pull phase
    one after the other, each at its busiest NIC, less what ``chunks`` pipelined chunks overlap
    (the shorter phase over their number). Strategies whose PS actors sit on every worker node
    move bytes both ways in each phase and lose little; one PS node serving the others, or a held
    step (``_pipeline_chunks``), pays both phases in full."""
    W, Nw = t.W, t.Nw
    wk, hw = t.workers[:, None], t.has_w[:, None]
    lr_extra = np.maximum(wk - 1, 0)             # workers of a node beyond the one that pushes its sum
    H0, H1, Q = ps.values, ps.lr_values, ps.pushed_each
    # local replication: a node's workers sum their gradients, push once per PS node, pull once
    srv_in, srv_out = (W - wk) * Q + (Nw - hw) * H1, (W - wk) * H0 + (Nw - hw) * H1
    cli_out = wk * (ps.pushed_each_total - Q) + hw * (ps.lr_total - H1)
    cli_in = wk * (ps.values_total - H0) + hw * (ps.lr_total - H1)
    intra = wk * (Q + H0) + 2 * hw * H1 + 2 * lr_extra * ps.lr_total
    S, hier = ring.buffer, ring.hier
    if t.ar_curve is not None:
        nic_ring = 0.0                           # measured: the curve holds the collectives' time
    elif Nw > 1:
        nic_ring = ring.nic_share * S * hw
        intra = intra + S * np.where(hier, 2 * lr_extra, ring.share * lr_extra)
    else:
        nic_ring = 0.0
        intra = intra + S * np.where(hier, 2 * lr_extra, ring.share * wk)
    nic_in, nic_out = srv_in + cli_in + nic_ring, srv_out + cli_out + nic_ring
    C = COL
    bw = t.bw[:, None]
    f[C["nic_in_s"]] = (nic_in / bw).max(0)
    f[C["nic_out_s"]] = (nic_out / bw).max(0)
    f[C["intra_s"]] = intra.max(0) / t.intra_bw
    f[C["wire_s"]] = np.maximum(np.maximum(f[C["nic_in_s"]], f[C["nic_out_s"]]), f[C["intra_s"]])
    pushes = ((np.maximum(srv_in, cli_out) + nic_ring) / bw).max(0)
    pulls = (np.maximum(cli_in, srv_out) / bw).max(0)
    phased = np.maximum(pushes, pulls) + np.minimum(pushes, pulls) / chunks
    f[C["wire_s"]] = np.where(sync_ps, np.maximum(f[C["wire_s"]], phased), f[C["wire_s"]])


def _ps_columns(f: np.ndarray, t: FeatureTables, a: FeatureSums, ps: _PsNodes, ring: _Ring,
                held: np.ndarray | None) -> None:
    """The cluster's sizes and the parameter servers' bytes, balance and round trips."""
    N, W, V, Nw = t.N, t.W, t.V, t.Nw
    C = COL
    ps_vars = a.psum[0]                          # PS variables per strategy
    any_ps = ps_vars > 0
    f[C["compute_s"]] = t.compute_s
    f[C["model_bytes"]] = t.model_bytes
    f[C["num_workers"]], f[C["num_nodes"]], f[C["nodes_with_workers"]] = W, N, t.Nw
    ps_bytes = ps.hosted_total + ps.values_total + ps.lr_total
    f[C["ps_share"]] = ps_bytes / np.maximum(ps_bytes + ring.share * ring.buffer, 1.0)
    f[C["ps_vars_frac"]] = ps_vars / V
    push_max, push_sum = ps.pushed.max(0), ps.pushed.sum(0)
    f[C["ps_push_max_node_bytes"]] = push_max
    f[C["ps_push_sum_bytes"]] = push_sum
    f[C["ps_imbalance"]] = push_max / np.maximum(push_sum / N, 1e-9) * any_ps
    f[C["ps_pull_max_node_bytes"]] = ps.pulled.max(0)
    f[C["ps_pull_sum_bytes"]] = ps.pulled.sum(0)
    used = (ps.hosted > _EMPTY_BYTES).sum(0)
    f[C["ps_nodes_used"]] = used
    f[C["ps_messages"]] = 2 * W * used
    f[C["server_bytes_max"]] = push_max
    # a worker's push and pull round trips, every PS node at once; on a calibrated cluster each
    # counts as its measured round trip, in units of the default one (``AlphaBeta.alpha_ps_s``)
    rtt = 1.0 if t.ps_round_trip_s is None else t.ps_round_trip_s / DEFAULT_PARAMS.alpha_ps_s
    # a held step adds one: every worker asks each PS actor its part of the norm once all pushes
    # are in, then sends the scale (``ps_clip``)
    f[C["ps_latency_rounds"]] = (2 * any_ps + (0 if held is None else held)) * rtt
    f[C["lr_saved_bytes"]] = 2 * ps.lr_total * (W - Nw)
    f[C["sparse_ps_bytes"]] = a.psum[1]


def _cpu_columns(f: np.ndarray, t: FeatureTables, p: AlphaBeta, ps: _PsNodes, ring: _Ring, scalars: dict,
                 ar_values: np.ndarray) -> None:
    """CPU work on each node (Ray serialization, sums, optimizer updates, casts, CPU collectives)."""
    W, Nw = t.W, t.Nw
    wk, hw = t.workers[:, None], t.has_w[:, None]
    lr_extra = np.maximum(wk - 1, 0)
    S, hier, H1tot = ring.buffer, ring.hier, ps.lr_total
    C = COL
    hosts = ps.hosted > _EMPTY_BYTES
    # calls a PS node's actor serves one after another: a push and a pull per worker (per node for
    # variables with local replication only)
    calls = 2 * hosts * np.where(ps.pushed_each > _EMPTY_BYTES, W, Nw)
    # deserialize and sum the pushes, serialize the pulls, update the parameters
    server = 2 * ps.pushed + ps.pulled + UPDATE_PASSES * (ps.values + ps.lr_values)
    worker = wk * (ps.pushed_each_total + ps.values_total) + 2 * hw * H1tot + 2 * lr_extra * H1tot
    worker += wk * (scalars["fp16_raw"] + scalars["psgd_raw"])   # a cast / projection pass per value
    # every worker updates its own copy of each all-reduced variable (``ar_values``: whole bytes),
    # a whole table too (Keras' Adam decays both moments on every row), on the CPUs it computes on
    worker += wk * UPDATE_PASSES * ar_values * t.cpu_contention
    # collectives on the CPU (no GPU: ring on CPU; hierarchical: the leader sums and broadcasts);
    # a calibrated curve holds that work already
    ar_cpu = S * np.where(hier, 2 * lr_extra + 2 * ring.nic_share * hw, 2 * ring.share * wk) * (t.ar_curve is None)
    # on the CPU where a node has no GPU, or where the strategy's backend reduces in host memory
    on_cpu = np.maximum(t.cpu_collectives[:, None], scalars["cpu_ring"][None, :])
    cpu = (server + worker + ar_cpu * on_cpu) / t.lanes[:, None]
    f[C["ps_calls_max"]] = calls.max(0)
    f[C["cpu_bytes_max"]] = cpu.max(0)
    f[C["ps_update_bytes_max"]] = (UPDATE_PASSES * (ps.values + ps.lr_values)).max(0)
    f[C["local_agg_bytes"]] = (2 * lr_extra * H1tot).max(0) + S * hier * 2 * max(float(t.workers.max()) - 1, 0)
    f[C["cpu_contention"]] = t.cpu_contention
    f[C["hierarchical"]] = hier
    f[C["psgd_matrices"]] = scalars["psgd_n"]
    f[C["cpu_s"]] = cpu_time({n: f[C[n]] for n in ("cpu_bytes_max", "ps_calls_max", "psgd_matrices")}, p)


def _allreduce_columns(f: np.ndarray, t: FeatureTables, a: FeatureSums, ring: _Ring, scalars: dict) -> None:
    """All-reduce bytes, groups, collectives and ring steps; compression; staleness."""
    W, Nw = t.W, t.Nw
    S, hier, ps_vars = ring.buffer, ring.hier, a.psum[0]
    C = COL
    n_coll = scalars["n_coll"]
    objectstore = (a.asum[0] > 0) & (scalars["objectstore"] > 0)
    f[C["ar_raw_bytes"]] = a.asum[2]
    f[C["ar_wire_bytes"]] = S
    f[C["ar_ring_bytes"]] = ring.share * S
    f[C["ar_ring_s"]] = ring.share * S / t.ring_bw
    f[C["ar_groups"]] = scalars["n_groups"]
    f[C["ar_collectives"]] = n_coll
    f[C["ar_max_group_bytes"]] = scalars["max_group"]
    steps = n_coll * np.where(hier, 2 * (Nw - 1) + 2 * (t.workers.max() > 1), 2 * max(W - 1, 0))
    # NCCL where every node with workers has GPUs and the backend does not reduce in host memory (a
    # node without workers, e.g. one that hosts parameter servers alone, takes no part in the ring)
    ring_nodes = t.cpu_collectives[t.workers > 0]
    nccl = (scalars["cpu_ring"] == 0) & (ring_nodes.size > 0 and float(ring_nodes.max()) == 0)
    ring_steps = steps * ~objectstore * (t.ar_curve is None)
    f[C["ring_steps"]] = ring_steps * ~nccl
    f[C["nccl_ring_steps"]] = ring_steps * nccl
    if t.ar_curve is not None:
        # fused buffers and (as one buffer) the all-gathers on the measured curve; hierarchical:
        # the leaders' ring moves ring_n / ring of the flat ring's bytes
        gathered = t.ar_curve.seconds(ring.gather * (W / 2)) if len(t.sparse_cols) else 0.0
        f[C["ar_curve_s"]] = ((scalars["curve_ns"].astype(np.float64) * 1e-9 + gathered)
                              * np.where(hier, ring.nic_share / max(ring.share, 1e-12), 1.0))
    f[C["ring_steps_objectstore"]] = steps * objectstore
    f[C["compressed_saved_bytes"]] = a.asum[3] - ring.wire_dense
    f[C["fp16_raw_bytes"]] = scalars["fp16_raw"]
    f[C["powersgd_raw_bytes"]] = scalars["psgd_raw"]
    f[C["sparse_allgather_bytes"]] = ring.gather * max(W - 1, 0)
    stale = scalars["stale"]
    asyn = ps_vars > scalars["sync"]             # a PS variable with sync 0
    f[C["staleness"]] = stale
    # staleness hides PS traffic behind the next step's compute only where the runtime pulls ahead
    # (``worker.run``): every variable on a synchronous PS with staleness >= 1. An all-reduced
    # variable's channel, or an asynchronous PS (the plan's staleness 0), keeps the pull in the
    # step, so nothing hides there
    ahead = ~asyn & (stale >= 1) & (a.asum[0] <= 0)
    f[C["stale_factor"]] = np.where(ahead, 1.0 / (1.0 + stale), 1.0)
    f[C["async"]] = asyn


def _overlap_columns(f: np.ndarray, t: FeatureTables, p: AlphaBeta, a: FeatureSums, ring: _Ring) -> None:
    """Overlap with the backward pass (pipe bound at ready-order breakpoints), then the estimate."""
    C = COL
    terms = {n: f[C[n]] for n in TERMS if n != "exposed_frac"}
    T0 = comm_time(terms, DEFAULT_PARAMS)
    # wire weight per variable, psf * ps_wire + ring * wv, past each breakpoint (sparse AR: below)
    suffix = a.psum[4:] + a.wsum * np.float32(ring.share)
    if len(t.sparse_cols):
        suffix += t.sparse_after[:, None] * (ring.gather * (t.W / 2) * ring.share)
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


def terms_of(X: np.ndarray) -> dict:
    """The alpha-beta terms (``alpha_beta.TERMS``) as float64 copies of a feature matrix's columns."""
    return {n: X[:, COL[n]].astype(np.float64) for n in TERMS}
