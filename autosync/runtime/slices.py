"""Summing a sparse gradient's slices row by row, bit for bit as ``np.add.at`` (Keras' dense
scatter-add) sums them: what a parameter-server worker sends for a table (``dedup_rows``,
``dedup_aligned`` on the rows it pulled, ``dedup_aligned_many`` for all its tables at once) and
how a parameter server adds up several senders' (``merge_rows``)."""
from __future__ import annotations

import numpy as np


def dedup_rows(indices: np.ndarray, values: np.ndarray, with_squares: bool, dtype=np.int32):
    """Sum the slices of repeated rows of a sparse gradient: what a worker sends for it.

    Keras optimizers that square the gradient (Adam, Adagrad) square each slice before repeated
    rows add up, so where a row repeats they need the sum of squared slices as well; it is sent
    only for those rows (for a row seen once it equals the square of its value).

    Args:
        dtype: the integer dtype of the row ids and positions returned (``index_dtype``).

    Returns:
        ``(rows, sums)`` (rows sorted, unique), plus ``(positions, square_sums)`` of the
        repeated rows when ``with_squares`` and some row repeats.
    """
    indices = np.asarray(indices)
    values = np.asarray(values)
    rows, inverse, counts = np.unique(indices, return_inverse=True, return_counts=True)
    rows = rows.astype(dtype)
    if len(rows) == len(indices):
        order = np.argsort(indices, kind="stable")
        return rows, values[order]
    sums = scatter_sum(inverse, values, len(rows))
    if not with_squares:
        return rows, sums
    repeated = np.flatnonzero(counts > 1).astype(dtype)
    squares = scatter_sum(inverse, np.square(values), len(rows))
    return rows, sums, repeated, squares[repeated]


ROUNDS_MAX = 8   # slices of one row beyond which ``scatter_sum`` leaves the sum to ``np.add.at``


def scatter_sum(inverse: np.ndarray, values: np.ndarray, n: int, dtype=None) -> np.ndarray:
    """``np.add.at`` of ``values`` into ``n`` zero rows at ``inverse``, bit for bit (each row is
    0 plus its slices in their order), faster: the k-th slice of every row is added in round k,
    an indexed add over distinct rows (2-9x faster than ``np.add.at`` where rows repeat a few
    times); the slices of rows with more than ``ROUNDS_MAX``: ``np.add.at`` itself."""
    values = np.asarray(values)
    out = np.zeros((n,) + values.shape[1:], dtype or values.dtype)
    if not len(inverse):
        return out
    counts = np.bincount(inverse, minlength=n)
    hot = counts > ROUNDS_MAX
    if hot.any():   # those rows' slices by ``np.add.at``, in order; the others in rounds
        slices = hot[inverse]
        np.add.at(out, inverse[slices], values[slices])
        if slices.all():
            return out
        inverse, values = inverse[~slices], values[~slices]
        counts = np.where(hot, 0, counts)
    if counts.max() == 1:   # no row repeats: one round, no order to find
        out[inverse] += values
        return out
    order = np.argsort(inverse, kind="stable")
    rank = np.arange(len(order)) - (np.cumsum(counts) - counts)[inverse[order]]
    for k in range(int(counts.max())):
        take = order[rank == k]
        out[inverse[take]] += values[take]
    return out


def dedup_aligned(asked: np.ndarray, indices: np.ndarray, values: np.ndarray, with_squares: bool) -> tuple:
    """A sparse gradient deduplicated (``dedup_rows``) and laid out on the rows ``asked``: the
    sorted unique rows this worker pulled for the same step, which the parameter server
    remembers, so the push need not name its rows again: ``(None, sums)`` or ``(None, sums,
    positions, square_sums)``, positions (of the repeated rows) indexing ``asked``. One pass: each
    slice's place among ``asked`` by binary search, repeated rows summed there in order.

    A row asked for but not in the gradient gets a zero sum. That is the same update bit for bit
    for every optimizer the runtime runs: a dense update adds the zero to nothing, the row-only
    Adagrad adds 0 to the accumulator and subtracts exactly 0 from the row.

    Raises:
        ValueError: the gradient touches a row that was not asked for.
    """
    return dedup_aligned_many([(asked, indices, values)], with_squares)[0]


def dedup_aligned_many(items: list, with_squares: bool) -> list:
    """``dedup_aligned`` of each ``(asked, indices, values)`` of ``items``, in fewer numpy calls
    (dozens of tables otherwise pay a dozen per table and step): the gradients whose values share
    a row shape and dtype are laid end to end (each one's places moved past the rows asked before
    it), one ``scatter_sum`` sums them all, each result a view of its part.

    Raises:
        ValueError: for the first gradient that touches a row not asked for.
    """
    out = [None] * len(items)
    groups: dict = {}
    for i, (_, _, values) in enumerate(items):
        values = np.asarray(values)
        groups.setdefault((values.shape[1:], values.dtype.str), []).append(i)
    for members in groups.values():
        places, values, starts, base = [], [], [], 0
        for i in members:
            asked, indices, vals = items[i]
            indices = np.asarray(indices)
            place = np.searchsorted(asked, indices)
            if len(indices) and (place.max() >= len(asked) or not np.array_equal(asked[place], indices)):
                raise ValueError(f"the gradient touches rows {np.setdiff1d(indices, asked)[:5].tolist()} that were "
                                 f"not pulled for this step")
            places.append(place + base)
            values.append(np.asarray(vals))
            starts.append(base)
            base += len(asked)
        place, vals = np.concatenate(places), np.concatenate(values)
        counts = np.bincount(place, minlength=base)
        sums = scatter_sum(place, vals, base)
        squares = None
        for i, start in zip(members, starts):
            asked = items[i][0]
            end = start + len(asked)
            repeated = np.flatnonzero(counts[start:end] > 1).astype(asked.dtype)
            if not (with_squares and len(repeated)):
                out[i] = (None, sums[start:end])
                continue
            if squares is None:
                squares = scatter_sum(place, np.square(vals), base)
            out[i] = (None, sums[start:end], repeated, squares[start + repeated.astype(np.int64)])
    return out


def merge_rows(parts: list, with_squares: bool):
    """Sum several senders' deduplicated sparse gradients (``dedup_rows`` outputs, row ids of one
    dtype) into one of the same form: what a node sends for the rows its workers touched."""
    rows = np.concatenate([p[0] for p in parts])
    values = np.concatenate([p[1] for p in parts])
    unique, inverse, counts = np.unique(rows, return_inverse=True, return_counts=True)
    sums = scatter_sum(inverse, values, len(unique))
    if not with_squares:
        return unique, sums
    squares, repeated = [], []
    for p in parts:
        sq = np.square(p[1])
        flag = np.zeros(len(p[0]), dtype=bool)
        if len(p) > 2:
            sq[p[2]] = p[3]
            flag[p[2]] = True
        squares.append(sq)
        repeated.append(flag)
    total = scatter_sum(inverse, np.concatenate(squares), len(unique), sums.dtype)
    flags = scatter_sum(inverse, np.concatenate(repeated).astype(np.int64), len(unique))
    pos = np.flatnonzero((counts > 1) | (flags > 0)).astype(rows.dtype)
    if not len(pos):
        return unique, sums
    return unique, sums, pos, total[pos]
