"""Per-cell quantities for the incremental featurizer (``tuner.features.incremental``): the arithmetic of
``features.sums.block_sums`` on a flat list of cells (variable, field values) instead of a (B, V)
batch, so that the features of a few changed cells are bit for bit ``featurize``'s.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strategy_space.encoding import KIND_PS

from tuner.features.sums import POWERSGD_ID
from tuner.features.tables import FeatureTables, powersgd_shard_bytes


@dataclass
class CellParts:
    """Per-cell quantities of ``features.sums.block_sums`` (float32 unless said)."""

    arf: np.ndarray      # 1 for all-reduce
    X: np.ndarray        # base-shard bytes on the line (unstrided all-reduce: the whole buffer)
    Y: np.ndarray        # one more slice, for the first e2 shards
    e2: np.ndarray       # int: shards with one slice more on the line
    e3: np.ndarray       # int: shards on the line (unstrided all-reduce: 1)
    extra: np.ndarray    # int: shards with one slice more
    wv: np.ndarray       # all-reduce wire bytes of the whole variable
    is16: np.ndarray     # fp16 compressor
    psgd: np.ndarray     # bool: PowerSGD on a matrix
    psgd_mats: np.ndarray  # PowerSGD matrices (a compressed matrix's shards)
    gathers: np.ndarray  # all-gathers (sparse all-reduce shards)
    line: np.ndarray     # int: PS lane (0 plain, 1 local replication of a dense variable)
    cls: np.ndarray      # int: all-reduce class (0 none, 1 fp16*, 2 powersgd*)
    sparse_ps: np.ndarray  # bool: sparse PS cells (index bytes lane)
    Xs: np.ndarray       # their base-shard index bytes
    Ys: np.ndarray       # one more slice


def cell_parts(t: FeatureTables, v: np.ndarray, f: dict) -> CellParts:
    """Quantities of cells (variables ``v`` with field values ``f``): ``features.sums.block_sums``'
    arithmetic on a flat list of cells (gathers of the tables instead of broadcasts)."""
    if f["axis"].any():
        dim = t.dims[v, f["axis"]].astype(np.float32)
        sv, si, cols = t.val_bytes[v] / dim, t.idx_bytes[v] / dim, t.size[v] / dim
    else:
        dim, sv, si, cols = t.dim0[v], t.sv0[v], t.si0[v], t.cols0[v]
    kf = f["shards"].astype(np.float32)
    arf = f["kind"].astype(np.float32)
    psf = 1.0 - arf
    base = np.floor(dim / kf)
    extra = dim - base * kf
    comp = f["compressor"]
    is16 = ((comp - 1).view(np.uint32) < 2).astype(np.float32)
    wv = arf * t.val_dense[v] + is16 * t.half_val[v]
    lay = psf + f["group_stride"].astype(np.float32)
    X = sv * base
    Y = lay * sv
    shrink = is16 * t.half_m1[v] + 1.0
    X *= shrink
    Y *= shrink
    psgd = (comp >= POWERSGD_ID) & t.matrix[v]
    if psgd.any():
        r = f["rank"][psgd].astype(np.float32)
        fb, fe = powersgd_shard_bytes(t, v[psgd], f["axis"][psgd], base[psgd], cols[psgd], r, t.elem_bytes[v[psgd]])
        X[psgd] = fb
        Y[psgd] = (fe - fb) * lay[psgd]
        wv[psgd] = kf[psgd] * fb + extra[psgd] * (fe - fb)
    X = X * lay + wv * (1.0 - lay)
    sparse = t.sparse[v]
    gathers = sparse * arf   # sparse all-reduce variables are all-gathered, never in a group
    keep = 1.0 - gathers
    X *= keep
    Y *= keep
    return CellParts(
        arf=arf, X=X, Y=Y, e2=(extra * lay).astype(np.int64), e3=((kf - 1.0) * lay + 1.0).astype(np.int64),
        extra=extra.astype(np.int64), wv=wv, is16=is16, psgd=psgd, psgd_mats=psgd * kf, gathers=gathers * kf,
        line=f["local_replication"] * t.dense_i[v], cls=(comp + 1) >> 1,
        sparse_ps=sparse & (f["kind"] == KIND_PS), Xs=si * base * psf, Ys=si * psf)
