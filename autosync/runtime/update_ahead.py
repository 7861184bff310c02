"""Updating ahead: the part of a parameter server's update that no gradient decides, computed while
the server waits for the step's pushes.

Adam's moments decay on every row of an embedding, and so does SGD's momentum: a step whose
gradient touches a few thousand rows of a table still rewrites all of it (Keras' own rule, which
the runtime keeps). On a synchronous parameter server that whole-table pass sits between the last
push of a step and the pull that waits for it: on ncf-full's shapes with Adam, an update of 99 ms,
30 ms once the untouched rows are done (``benchmarks/update_ahead.py``). Yet every row the step's
gradient does not touch moves as if its gradient were zero, which is known before any push
arrives. So when a step's first push reaches a parameter server, a thread of the optimizer's own computes the step's
update of each row-updated variable as if no row had a gradient, into new arrays; when the last
push is in, only the touched rows are computed again, from their values before the step, with the
same element-wise operations as the whole update (bit for bit its result), and the new arrays take
the variable's place. Readers of the old value are untouched: the new arrays are new.

The update ahead is used only where nothing changed the variable or its slots since it started
(same arrays, same step); otherwise it is dropped and the update runs whole, as before. A variable
updated ahead lives in two sets of arrays (value and slots) that take turns: the next update ahead
writes into the arrays of the step before, once no pull still reads them (else into new ones).
Variables whose value and slots exceed ``AHEAD_MAX_BYTES`` are updated whole, in place, never
doubled, and so are values under ``AHEAD_MIN_BYTES`` (cheaper whole than finished). Where the
last push comes too soon after the first (the last update ahead was still running and the step
waited for it more than half of its time and over ``AHEAD_LATE_S``: copying the arrays and
recomputing the touched rows then cost more than they hid), only every ``AHEAD_PROBE``-th step is
updated ahead until one is on time again.
"""
from __future__ import annotations

import concurrent.futures
import time
import weakref

import numpy as np

from autosync.runtime.slices import ScatterPlan

AHEAD_MAX_BYTES = 512 << 20   # a variable's value and slots together, beyond which it is not doubled
# a smaller value is updated whole: its whole update costs less than finishing one from an update
# ahead (``benchmarks/update_ahead.py``: dlrm's small tables with momentum 0.88x, ncf's 0.96-1.08x)
AHEAD_MIN_BYTES = 1 << 20
AHEAD_PROBE = 8   # while updates ahead come late, one step in this many still tries
AHEAD_LATE_S = 1e-3   # a wait for an update ahead under this is never late (a loaded machine's hiccup)


def row_sums(grad, dtype, squares_needed: bool):
    """A sparse gradient ``(indices, values[, squares])`` as its distinct rows (ascending), the sum
    of the slices of each row and, if ``squares_needed``, the sum of their squared slices (Keras
    squares each slice before repeated rows add up; ``squares`` given: the sender's sums).

    Sums are taken in slice order from zero, as a dense scatter-add: bit for bit its touched rows.
    A ``Summed`` gradient (``row_sums_many``) is returned as it is."""
    if isinstance(grad, Summed):
        return grad
    return row_sums_many({None: grad}, {None: dtype}, squares_needed)[None]


class Summed(tuple):
    """``(rows, sums, square sums or None)``: a sparse gradient already through ``row_sums``."""


def row_sums_many(grads: dict, dtypes: dict, squares_needed: bool) -> dict:
    """``row_sums`` of each sparse gradient of ``grads`` (key -> ``(indices, values[, squares])``,
    ``dtypes``: key -> the variable's dtype) as ``Summed``, the same arrays bit for bit, in fewer
    numpy calls: the gradients whose values share a row shape and dtypes are laid end to end (each
    one's row ids moved past the rows of those before it), so one ``np.unique`` and one
    ``ScatterPlan`` serve them all (a parameter server holding dozens of tables otherwise pays a
    dozen numpy calls per table and step). The row ids must be >= 0 (``rows.received_grad``)."""
    groups: dict = {}
    for key, grad in grads.items():
        values = np.asarray(grad[1])
        groups.setdefault((values.shape[1:], values.dtype.str, np.dtype(dtypes[key]).str), []).append(key)
    out = {}
    for members in groups.values():
        ids, values, squares, starts, base = [], [], [], [], 0
        for key in members:
            grad = grads[key]
            indices = np.asarray(grad[0])
            ids.append(indices.astype(np.int64) + base)
            values.append(np.asarray(grad[1]))
            if squares_needed:
                given = len(grad) > 2 and grad[2] is not None
                squares.append(np.asarray(grad[2]) if given else np.square(values[-1]))
            starts.append(base)
            base += int(indices.max()) + 1 if len(indices) else 0
        rows, inverse = np.unique(np.concatenate(ids), return_inverse=True)
        dtype = dtypes[members[0]]
        plan = ScatterPlan(inverse, len(rows))
        g = plan.sum(np.concatenate(values), dtype)
        g2 = plan.sum(np.concatenate(squares), dtype) if squares_needed else None
        cuts = [0, *np.searchsorted(rows, starts[1:]), len(rows)]
        for key, start, a, b in zip(members, starts, cuts[:-1], cuts[1:]):
            index_dtype = np.asarray(grads[key][0]).dtype
            out[key] = Summed(((rows[a:b] - start).astype(index_dtype), g[a:b], None if g2 is None else g2[a:b]))
    return out


class UpdateAhead:
    """What ``optimizers.NumpyOptimizer`` mixes in (module doc). A rule whose update moves rows
    that have no gradient sets ``moves_untouched_rows``; its ``_update`` takes the slots to update
    (``slots``: a variable's slot arrays, or those of some of its rows)."""

    moves_untouched_rows = False
    _ahead: dict   # key -> (step, value and slots before it, the update ahead's future)
    _spare: dict   # key -> (value, slots, readers of the value) of the step before, to write into
    _pool: concurrent.futures.ThreadPoolExecutor | None = None
    _late = False   # the last update ahead kept its step waiting (module doc)
    ahead = 0   # updates finished from an update ahead

    def update_ahead(self, iteration: int, params: dict, keys) -> None:
        """Start computing update ``iteration`` of each of ``keys`` (row-updated variables) as if no
        row had a gradient, on the optimizer's own thread; ``apply`` finishes it."""
        if not self.moves_untouched_rows or (self._late and iteration % AHEAD_PROBE):
            return
        for key in keys:
            if key in self._ahead or key not in self.slots:
                continue
            before, slots = params[key], dict(self.slots[key])
            if not AHEAD_MIN_BYTES <= before.nbytes <= AHEAD_MAX_BYTES // (1 + len(slots)):
                continue
            spare = self._spare.pop(key, None)
            if spare is not None and any(r() is not None for r in spare[2]):
                spare = None   # a pull still reads the value of the step before
            self.copies += spare is None
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="update-ahead")
            self._ahead[key] = (iteration, before, slots,
                                self._pool.submit(self._zero_step, iteration, key, before, slots, spare))

    def wait_ahead(self) -> None:
        """Block until every update ahead started so far is computed (a benchmark or a test that
        times or checks the finish apart from the update ahead)."""
        for pending in self._ahead.values():
            pending[3].result()

    def _zero_step(self, iteration: int, key, var: np.ndarray, slots: dict, spare):
        t0 = time.perf_counter()
        if spare is None:
            var = np.array(var, copy=True, order="C")
            slots = {name: np.array(a, copy=True, order="C") for name, a in slots.items()}
        else:
            for out, a in zip((spare[0],) + tuple(spare[1][n] for n in slots), (var,) + tuple(slots.values())):
                np.copyto(out, a)
            var, slots = spare[0], spare[1]
        self._decay(var, key)
        empty = np.zeros((0,) + var.shape[1:], var.dtype)
        self._update_blocked(iteration, key, var, np.zeros(0, np.int64), empty, empty if self.squares_slices else None,
                             slots)
        return var, slots, time.perf_counter() - t0

    def _finish_ahead(self, iteration: int, params: dict, key, grad) -> bool:
        """Finish ``key``'s update from its update ahead (module doc); False when there is none
        that holds (the caller updates whole). Waits for one still running."""
        ahead = self._ahead.pop(key, None)
        if ahead is None:
            return False
        it, before, before_slots, future = ahead
        t0 = time.perf_counter()
        try:
            var, slots, took = future.result()
        except Exception:   # e.g. no memory for the second arrays: the whole update, in place, still runs
            return False
        self._late = time.perf_counter() - t0 > max(took / 2, AHEAD_LATE_S)
        if (it != iteration or not isinstance(grad, tuple) or params[key] is not before
                or any(self.slots[key].get(n) is not a for n, a in before_slots.items())):
            return False
        rows, g, g2 = row_sums(grad, var.dtype, self.squares_slices)
        touched = before[rows]   # copies: the rows as they were before the step
        touched_slots = {name: a[rows] for name, a in before_slots.items()}
        self._decay(touched, key)
        self._update(iteration, key, touched, None, g, g2, touched_slots)
        var[rows] = touched
        for name, a in slots.items():
            a[rows] = touched_slots[name]
        owned = self._owned.get(key)
        readers = self._readers.pop(key, [])   # they read the value before, which no update writes while they do
        if owned is not None and owned() is before:   # ours (not a received view): the next update ahead's arrays
            self._spare[key] = (before, before_slots, readers)
        params[key], self.slots[key] = var, slots
        self._owned[key] = weakref.ref(var)
        self.ahead += 1
        return True
