"""Per-strategy sums over variables of a batch of encoded strategies (``FeatureSums``), block by
block: the first half of ``features.batch.featurize`` (``features.batch.assemble`` turns the sums into
features). The traffic accounting is described in ``tuner.features.batch``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from strategy_space.encoding import BACKEND_ID, COMPRESSOR_ID, EncodedStrategies

from tuner.features.tables import FeatureTables, cpu_ring, curve_ns, powersgd_shard_bytes

POWERSGD_ID = COMPRESSOR_ID["powersgd"]


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
                                  "max_group", "hier", "curve_ns", "cpu_ring", "psgd_n"))}



def _axis_facts(t: FeatureTables, e: EncodedStrategies):
    """Slices along the partition axis, value/index bytes per slice and values per slice: (V,)
    vectors when every variable is split along axis 0 (the sampler's case), else (B, V)."""
    if not e.axis.any():
        return t.dim0, t.sv0, t.si0, t.cols0
    dim = t.dims[np.arange(t.V), e.axis].astype(np.float32)
    return dim, t.val_bytes / dim, t.idx_bytes / dim, t.size / dim


@dataclass
class _ShardBytes:
    """Per-variable quantities of a block, (B, V) float32 unless said: how its shards lie on their
    line (PS: from the destination node; all-reduce: from the fusion group) and what they weigh.

    Shard i at start + i carries X + Y*[i < e2] bytes up to start + e3 (exclusive):
      PS:           X = base-shard value bytes, Y = one slice, e2 = extra, e3 = k
      AR strided:   the same with compressed bytes
      AR unstrided: X = wv (the whole variable in one group), Y = 0, e3 = 1
    """

    shards: np.ndarray      # k
    ar: np.ndarray          # 1 for all-reduce variables (KIND_AR == 1)
    ps: np.ndarray          # 1 for PS variables
    base: np.ndarray        # slices of a base-size shard (exact in float32)
    extra: np.ndarray       # that many (the first) shards have one slice more
    index_slice: np.ndarray  # index bytes per slice ((V,) or (B, V): ``_axis_facts``)
    fp16: np.ndarray        # 1 under fp16 or fp16_ef
    ar_wire: np.ndarray     # wv: all-reduce wire bytes of the whole variable
    spread: np.ndarray      # lay: 1 where shards spread over the line (PS, strided AR)
    X: np.ndarray
    Y: np.ndarray
    psgd_rows: np.ndarray | None   # strategy of each PowerSGD matrix cell (None: no such cell)
    psgd_vars: np.ndarray | None   # its variable


def _shard_bytes(t: FeatureTables, e: EncodedStrategies) -> _ShardBytes:
    """The block's shard layout and bytes (``_ShardBytes``)."""
    # Budget: ~0.2 ns per element for a float32/int32 (B, V) pass, ~2.5 ns per bincount entry,
    # ~3.5 ns per gathered element. So: no gathers on the common path, no int32 x float32 mixes
    # (they promote to float64), sums over variables as matrix products, one bincount per block.
    B, V = len(e), t.V
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
    lay = psf + stride                           # 1 where shards spread over the line
    X = sv * base                                # per-shard value bytes (raw)
    Y = lay * sv                                 # AR unstrided: 0
    shrink = is16 * t.half_m1                    # fp16 strided shards: half the bytes
    shrink += 1.0
    X *= shrink
    Y *= shrink
    psgd_rows = pv = None
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
    return _ShardBytes(kf, arf, psf, base, extra, si, is16, wv, lay, X, Y, psgd_rows, pv)


def _line_sums(t: FeatureTables, e: EncodedStrategies, sb: _ShardBytes, work) -> tuple[np.ndarray, int, int]:
    """The difference entries of every shard on its line, summed by one bincount per block:
    (B, 2 L + 3 G) with L the PS line's length and G the all-reduce line's, laid out
    [PS no-LR line | PS LR line | AR lines x {raw, fp16, psgd}]; returns it with L and G."""
    B, V, N = len(e), t.V, t.N
    kmax = int(e.shards.max())
    L = _round_up(N + kmax, N)                   # PS line, a whole number of N-node rounds
    G = int(e.group.max()) + kmax + 1            # AR line: groups, strided shards reach g + k - 1
    BIN = 2 * L + 3 * G
    # class by compressor id: none 0, fp16/fp16_ef 1, powersgd/powersgd_ef 2 (PS: 0)
    off = (e.compressor + 1) >> 1
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
    e3 = sb.shards - 1.0
    e3 *= sb.spread
    e3 += 1.0
    np.add(off, e3.astype(np.int32), out=idx[nbv:2 * nbv].reshape(B, V))
    e2 = sb.extra * sb.spread
    np.add(off, e2.astype(np.int32), out=idx[2 * nbv:].reshape(B, V))
    # in float64, so that X + Y, -X and -Y cancel exactly past a shard's end (in float32 the sum
    # rounds and an empty node or group would hold ~1e-7 x the variable's bytes)
    np.add(sb.X, sb.Y, out=wts[:nbv].reshape(B, V), dtype=np.float64)
    np.negative(sb.X, out=wts[nbv:2 * nbv].reshape(B, V))
    np.negative(sb.Y, out=wts[2 * nbv:].reshape(B, V))
    return np.bincount(idx, wts, minlength=B * BIN).reshape(B, BIN), L, G


def block_sums(t: FeatureTables, e: EncodedStrategies, out: FeatureSums, rows: slice, work) -> None:
    """Fill ``out``'s columns ``rows`` with the sums of the block ``e`` (``work``: the bincount
    entries' buffers, reused by every block)."""
    B, N = len(e), t.N
    sb = _shard_bytes(t, e)
    flat, L, G = _line_sums(t, e, sb, work)
    # the cumulative sums along the lines and the fold onto nodes are fixed linear maps of the
    # difference entries (``folded``: a matrix product on short lines, where numpy's cumsum is slow)
    out.hosted[:2, :, rows] = folded(flat[:, :2 * L].reshape(B * 2, L), N).reshape(B, 2, N).transpose(1, 2, 0)
    if t.sparse_cols.size:
        out.hosted[2, :, rows] = _sparse_index_hosting(t, e, sb.base, sb.extra, sb.ps, sb.index_slice).T
    groups = folded(flat[:, 2 * L:].reshape(B * 3, G), G).reshape(B, 3 * G)
    s = out.scal[:, rows].T                      # a view: written in place
    _group_scalars(t, groups, G, s)
    # sums over variables as matrix products, in float64: sums of float32 terms are then exact (bar
    # magnitudes ~2^30 apart), the same in any order (tuner.features.incremental adds them cell by cell)
    out.psum[:, rows] = (sb.ps.astype(np.float64) @ t.ps_right).T
    out.asum[:, rows] = (sb.ar.astype(np.float64) @ t.sums).T
    out.wsum[:, rows] = (sb.ar_wire.astype(np.float64) @ t.after).T
    s[:, SCALAR_ROWS["fp16_raw"]] = sb.fp16.astype(np.float64) @ t.val_bytes
    s[:, SCALAR_ROWS["psgd_raw"]] = (np.bincount(sb.psgd_rows, t.val_bytes[sb.psgd_vars], minlength=B)
                                     if sb.psgd_rows is not None else 0.0)
    # PowerSGD matrices: each shard of a compressed matrix is one
    s[:, SCALAR_ROWS["psgd_n"]] = (np.bincount(sb.psgd_rows, sb.shards[sb.psgd_rows, sb.psgd_vars], minlength=B)
                                   if sb.psgd_rows is not None else 0.0)
    s[:, SCALAR_ROWS["stale"]] = e.staleness.max(1)       # 0 for AR variables (normalized)
    s[:, SCALAR_ROWS["sync"]] = e.sync.astype(np.float32) @ t.ones   # PS variables with sync (AR: 0)
    # one backend per strategy; PS variables encode 0 and objectstore is the largest id
    backend = e.backend.max(1)
    s[:, SCALAR_ROWS["objectstore"]] = backend == BACKEND_ID["objectstore"]
    s[:, SCALAR_ROWS["cpu_ring"]] = cpu_ring(backend)
    s[:, SCALAR_ROWS["hier"]] = e.hierarchical.max(1)     # one hierarchy per strategy (PS variables encode 0)
    if t.sparse_cols.size:
        c = t.sparse_cols                        # all-gathers: one per sparse AR shard
        s[:, SCALAR_ROWS["n_coll"]] += (sb.ar[:, c] * sb.shards[:, c]).sum(1)


def _group_scalars(t: FeatureTables, groups: np.ndarray, G: int, s: np.ndarray) -> None:
    """Fusion-group counts and sizes of a block from its (B, 3 G) bytes per group and class."""
    total = groups[:, :G] + groups[:, G:2 * G]
    total += groups[:, 2 * G:]
    # buffers carry whole bytes; an empty one holds rounding noise only
    s[:, SCALAR_ROWS["n_groups"]] = np.count_nonzero(total > 0.5, axis=1)
    s[:, SCALAR_ROWS["n_coll"]] = np.count_nonzero(groups > 0.5, axis=1) + np.count_nonzero(groups[:, 2 * G:] > 0.5, axis=1)
    s[:, SCALAR_ROWS["max_group"]] = total.max(1)
    if t.ar_curve is not None:
        s[:, SCALAR_ROWS["curve_ns"]] = curve_ns(t.ar_curve, total)


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
    return folded(flat.reshape(B, L), N)



def _round_up(x: int, n: int) -> int:
    return -(-x // n) * n


@functools.lru_cache(maxsize=8)
def _row_col(B: int, V: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of every flat index of a (B, V) array."""
    return np.repeat(np.arange(B), V), np.tile(np.arange(V), B)


# lines up to this long are folded by one product with a cached (L, n) matrix, faster than a cumsum
# over short rows; longer ones (clusters of hundreds of workers, thousands of shards) by a cumsum,
# whose time and memory grow as L rather than L * L
_FOLD_BY_PRODUCT = 512


def folded(flat: np.ndarray, n: int) -> np.ndarray:
    """(R, L) difference entries on lines of length L -> (R, n) their cumulative sums along each
    line folded modulo n: entry p adds to every position q >= p of its line, position q to column
    q % n (L is a multiple of n, or n itself)."""
    L = flat.shape[1]
    if L <= _FOLD_BY_PRODUCT:
        return flat @ _fold(L, n)
    sums = np.cumsum(flat, axis=1)
    return sums if n == L else sums.reshape(len(sums), L // n, n).sum(1)


@functools.lru_cache(maxsize=64)
def _fold(L: int, n: int) -> np.ndarray:
    """(L, n) map from difference entries on a line of length L to the cumulative sums folded
    modulo n (``folded``), for short lines."""
    q = np.arange(L)
    return (q[None, :] >= q[:, None]).astype(np.float64) @ (q[:, None] % n == np.arange(n)[None, :]).astype(np.float64)
