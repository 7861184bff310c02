"""Summing a sparse gradient's slices row by row, bit for bit as ``np.add.at`` (Keras' dense
scatter-add) sums them: what a parameter-server worker sends for a table (``dedup_rows``,
``dedup_aligned`` on the rows it pulled, ``dedup_aligned_many`` for all its tables at once) and
how a parameter server adds up several senders' (``merge_rows``); and the buffer an all-reduce
worker all-gathers a group's sparse gradients in (``sparse_frame``, ``read_sparse_frame``)."""
from __future__ import annotations

import numpy as np

from autosync.runtime.rows import index_dtype


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
    plan = ScatterPlan(inverse, len(rows))
    sums = plan.sum(values)
    if not with_squares:
        return rows, sums
    repeated = np.flatnonzero(counts > 1).astype(dtype)
    squares = plan.sum(np.square(values))
    return rows, sums, repeated, squares[repeated]


ROUNDS_MAX = 8   # rounds of a ``ScatterPlan``; a row's slices past them are added in one pass
TAIL_MAX = 4     # the padded block of those slices may hold this many times the values' elements


def stable_order(values: np.ndarray, bound: int) -> np.ndarray:
    """``np.argsort(values, kind="stable")`` of integers in [0, bound): by a radix sort where they
    fit 16 bits (numpy sorts those so, several times faster)."""
    if bound <= 1 << 16:
        values = values.astype(np.uint16)
    return np.argsort(values, kind="stable")


class ScatterPlan:
    """How slices at ``inverse`` add up into ``n`` zero rows, found once for every array of values
    laid on the same slices (a gradient's values and their squares): ``sum`` is ``np.add.at`` of
    them into zeros, bit for bit (each row is 0 plus its slices in their order), faster.

    The k-th slice of every row is added in round k (an indexed add over distinct rows, 2-9x
    faster than ``np.add.at`` where rows repeat a few times), for the first ``ROUNDS_MAX`` rounds;
    the slices of rows repeated more follow in one sequential sum over a padded block (row sum so
    far, then its next slices, then zeros), or ``np.add.at`` where that block would be large or
    the sum is taken in another dtype. Every row is summed in its slices' order, as ``np.add.at``
    sums (a trailing zero changes no sum: a sum that starts at +0 never becomes -0).
    """

    def __init__(self, inverse: np.ndarray, n: int, order: np.ndarray | None = None):
        """``order``: a stable argsort of ``inverse``, where the caller has one."""
        inverse = np.asarray(inverse)
        self.n, self.inverse = int(n), inverse
        self.rounds: list = []   # (positions of the round's slices or None for all, their rows)
        self.tail = None         # (positions in slice order, hot rows, block of positions or None)
        if not len(inverse):
            return
        counts = np.bincount(inverse, minlength=self.n)
        top = int(counts.max())
        if top == 1:   # no row repeats: one round, no order to find
            self.rounds = [(None if len(inverse) < self.n else np.argsort(inverse), inverse)]
            return
        order = stable_order(inverse, self.n) if order is None else order
        rank = np.arange(len(order)) - (np.cumsum(counts) - counts)[inverse[order]]
        by_round = order[stable_order(rank, top)]   # slice positions by (round, row)
        bounds = np.cumsum(np.bincount(rank))
        for a, b in zip([0, *bounds[:ROUNDS_MAX - 1]], bounds[:ROUNDS_MAX]):
            self.rounds.append((by_round[a:b], inverse[by_round[a:b]]))
        if top <= ROUNDS_MAX:
            return
        late = rank >= ROUNDS_MAX   # over ``order``: the slices past the rounds, row by row
        positions = np.sort(order[late])
        hot = np.flatnonzero(counts > ROUNDS_MAX)
        block = None
        if len(hot) * (top - ROUNDS_MAX + 1) <= TAIL_MAX * len(inverse):
            block = np.full((top - ROUNDS_MAX, len(hot)), -1, np.int64)
            block[rank[late] - ROUNDS_MAX, np.searchsorted(hot, inverse[order[late]])] = order[late]
        self.tail = (positions, hot, block)

    def sum(self, values: np.ndarray, dtype=None) -> np.ndarray:
        """The slices ``values`` summed into their rows (in ``dtype``, default the values')."""
        values = np.asarray(values)
        out = np.zeros((self.n,) + values.shape[1:], dtype or values.dtype)
        for take, rows in self.rounds:
            part = values if take is None else values[take]
            if len(rows) == self.n:   # every row, in order (a round's rows are distinct and sorted)
                np.add(out, part, out=out)   # cast as ``out[rows] += part`` casts (same kind)
            else:
                out[rows] += part
        if self.tail is None:
            return out
        positions, hot, block = self.tail
        if block is None or out.dtype != values.dtype:
            np.add.at(out, self.inverse[positions], values[positions])
            return out
        first = out[hot]
        # a reduction over the first axis adds its sub-arrays one after another, in order, where
        # they hold two elements or more (one element each: numpy sums the column pairwise)
        flat = np.zeros((1 + len(block), max(first.size, 2)), out.dtype)
        padded = flat[:, :first.size].reshape((1 + len(block),) + first.shape)
        padded[0] = first
        filled = block >= 0
        padded[1:][filled] = values[block[filled]]
        out[hot] = np.add.reduce(flat, axis=0)[:first.size].reshape(first.shape)
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
    """``dedup_aligned`` of each ``(asked, indices, values)`` of ``items``, in a few numpy calls
    for all of them (dozens of tables otherwise pay a dozen each per step): the gradients whose
    values share a row shape and dtype are laid end to end, each table's rows keyed past the rows
    of the tables before it, so one binary search places every slice, one ``ScatterPlan`` sums
    them all, and each result is a view of its part.

    Raises:
        ValueError: for the first gradient (of the first row shape) that touches a row not asked for.
    """
    out = [None] * len(items)
    groups: dict = {}
    for i, (_, _, values) in enumerate(items):
        values = np.asarray(values)
        groups.setdefault((values.shape[1:], values.dtype.str), []).append(i)
    for members in groups.values():
        asked = [np.asarray(items[i][0]) for i in members]
        indices = [np.asarray(items[i][1]) for i in members]
        starts = np.cumsum([0] + [len(a) for a in asked])
        # keys: a row plus its table's offset (the rows of the tables before it), sorted over all tables
        offsets = np.cumsum([0] + [int(a[-1]) + 1 if len(a) else 0 for a in asked[:-1]])
        keys = np.concatenate([a.astype(np.int64) + o for a, o in zip(asked, offsets)])
        table = np.repeat(np.arange(len(members)), [len(x) for x in indices])
        wanted = np.concatenate(indices).astype(np.int64) + offsets[table]
        # the slices in key order (a stable sort, so also in place order: the plan's), searched in
        # that order (a search of sorted keys is several times faster)
        order = np.argsort(wanted, kind="stable")
        place = np.empty(len(wanted), np.int64)
        place[order] = np.searchsorted(keys, wanted[order])
        # a slice belongs where it lands only if its own table holds its row
        bad = (place < starts[table]) | (place >= starts[table + 1])
        bad |= keys[np.minimum(place, max(len(keys) - 1, 0))] != wanted if len(keys) else True
        if bad.any():
            j = int(table[np.argmax(bad)])
            raise ValueError(f"the gradient touches rows {np.setdiff1d(indices[j], asked[j])[:5].tolist()} that "
                             f"were not pulled for this step")
        vals = np.concatenate([np.asarray(items[i][2]) for i in members])
        plan = ScatterPlan(place, int(starts[-1]), order)
        sums = plan.sum(vals)
        repeated = np.flatnonzero(np.bincount(place, minlength=int(starts[-1])) > 1)
        cuts = np.searchsorted(repeated, starts)
        squares = plan.sum(np.square(vals)) if with_squares and len(repeated) else None
        for j, i in enumerate(members):
            a, b = starts[j], starts[j + 1]
            if squares is None or cuts[j] == cuts[j + 1]:
                out[i] = (None, sums[a:b])
                continue
            mine = repeated[cuts[j]:cuts[j + 1]]
            out[i] = (None, sums[a:b], (mine - a).astype(asked[j].dtype), squares[mine])
    return out


def merge_rows(parts: list, with_squares: bool):
    """Sum several senders' deduplicated sparse gradients (``dedup_rows`` outputs, row ids of one
    dtype) into one of the same form: what a node sends for the rows its workers touched."""
    rows = np.concatenate([p[0] for p in parts])
    values = np.concatenate([p[1] for p in parts])
    unique, inverse, counts = np.unique(rows, return_inverse=True, return_counts=True)
    plan = ScatterPlan(inverse, len(unique))
    sums = plan.sum(values)
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
    total = plan.sum(np.concatenate(squares), sums.dtype)
    flags = plan.sum(np.concatenate(repeated).astype(np.int64))
    pos = np.flatnonzero((counts > 1) | (flags > 0)).astype(rows.dtype)
    if not len(pos):
        return unique, sums
    return unique, sums, pos, total[pos]


def sparse_frame(parts: list, members: list, squares: bool = False) -> tuple[np.ndarray, tuple]:
    """One worker's sparse gradients of a group as one int32 buffer for an all-gather, and the
    layout every worker reads the others' by (the same on every worker: it depends only on the
    members, their dtypes and ``squares``).

    A part is ``(row ids, values)``, or with ``squares`` as ``dedup_rows`` gives it where rows
    repeated, ``(rows, sums, positions of the repeated rows, their summed squared slices)``. The
    buffer holds, each padded to 4 bytes: the row count of each member (and with ``squares`` its
    count of repeated rows), every member's row ids in the narrowest integer dtype numbering the
    largest member's rows (then the repeated rows' positions, in it too), every member's values
    in one dtype wide enough for all (then the squares)."""
    ids_dtype = index_dtype(max(m.stop - m.start for m in members))
    wire = np.result_type(*[p[1].dtype for p in parts])
    widths = tuple(int(np.prod(np.shape(p[1])[1:], dtype=np.int64)) for p in parts)
    rows = tuple(tuple(np.shape(p[1])[1:]) for p in parts)
    repeated = [(p[2], p[3]) if len(p) > 2 else (np.zeros(0, ids_dtype), np.zeros((0,) + r, wire))
                for p, r in zip(parts, rows)] if squares else []
    counts = np.array([len(p[0]) for p in parts] + [len(pos) for pos, _ in repeated], dtype=np.int32)
    sections = [counts, np.concatenate([np.asarray(p[0]).astype(ids_dtype, copy=False) for p in parts])]
    if squares:
        sections.append(np.concatenate([np.asarray(pos).astype(ids_dtype, copy=False) for pos, _ in repeated]))
    sections.append(np.concatenate([np.asarray(p[1], dtype=wire).ravel() for p in parts]))
    if squares:
        sections.append(np.concatenate([np.asarray(sq, dtype=wire).ravel() for _, sq in repeated]))
    frame = b"".join(_padded(a.tobytes()) for a in sections)
    return np.frombuffer(frame, dtype=np.int32), (ids_dtype, wire, widths, rows, squares)


def read_sparse_frame(frame: np.ndarray, layout: tuple) -> list[tuple]:
    """Each member's part of one worker's ``sparse_frame``: ``(row ids, values)``, and with squares
    ``(row ids, values, squared slices summed per row)`` (a row's square of its value where it
    did not repeat)."""
    ids_dtype, wire, widths, rows, squares = layout
    raw = np.ascontiguousarray(frame).view(np.uint8)
    n = len(widths)
    header = 4 * n * (2 if squares else 1)
    counts = raw[:header].view(np.int32).astype(np.int64)
    at = header

    def take(count: int, dtype) -> np.ndarray:
        nonlocal at
        out = raw[at:at + count * dtype.itemsize].view(dtype)
        at += _pad_to(count * dtype.itemsize)
        return out

    width = np.array(widths, dtype=np.int64)
    ids = take(int(counts[:n].sum()), ids_dtype)
    positions = take(int(counts[n:].sum()), ids_dtype) if squares else None
    values = take(int(np.dot(counts[:n], width)), wire)
    squared = take(int(np.dot(counts[n:], width)), wire) if squares else None
    out, i, v, r, q = [], 0, 0, 0, 0
    for k, (c, w, row) in enumerate(zip(counts[:n].tolist(), widths, rows)):
        vals = values[v:v + c * w].reshape((c,) + row)
        if squares:
            sq = np.square(vals)
            reps = int(counts[n + k])
            sq[positions[r:r + reps].astype(np.int64)] = squared[q:q + reps * w].reshape((reps,) + row)
            out.append((ids[i:i + c], vals, sq))
            r, q = r + reps, q + reps * w
        else:
            out.append((ids[i:i + c], vals))
        i, v = i + c, v + c * w
    return out


def _pad_to(n: int) -> int:
    return (n + 3) // 4 * 4


def _padded(data: bytes) -> bytes:
    return data + bytes(_pad_to(len(data)) - len(data))
