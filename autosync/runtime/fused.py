"""Small dense variables updated together: one pass of a numpy rule over one buffer instead of one
pass per variable (``optimizers.NumpyOptimizer``: the all-reduced variables' local updates and a
parameter server's shards).

The numpy rules are element-wise, and each call costs a fixed ~1 us of Python and numpy dispatch
per operation whatever the variable's size: Adam makes about a dozen, ~12 us a variable
(``benchmarks/results/fused_update.json``: resnet50-small's 29 variables, 0.335 ms). A model of many
small variables (biases, normalization scales, the layers of a deep narrow network) spent much of
its synchronization there: a 602-variable MLP of 326 KB, all-reduced on one machine, 7.5 ms of its
26 ms step in the rule alone (py-spy). ``FusedUpdates`` keeps the small variables of one update
and their slots as views into one flat buffer each, so that a step updates them with one call of
the rule; every value goes through the same operations as alone (bit for bit the same update).
Plain SGD makes one pass, which costs less than joining its gradients: it stays per variable.

The views replace the arrays in the holder's ``params`` and the optimizer's ``slots`` (a
checkpoint reads and names them per variable as before). Where something replaced one of them
since (a restore, a copy on write), the buffer is built again from the current values.
"""
from __future__ import annotations

import weakref

import numpy as np

SMALL_VALUES = 1 << 15   # variables of at most this many values are updated together (128 KiB of float32)
MIN_FUSED = 4   # fewer small variables than this in one update: one call each, as before


class _Group:
    """The flat buffers of one set of variables: ``var`` and each slot's, and per key its views."""

    def __init__(self, keys: tuple, params: dict, slots: dict, names: tuple):
        self.keys = keys
        self.var = np.concatenate([np.ravel(params[k]) for k in keys])
        self.slots = {n: np.concatenate([np.ravel(slots[k][n]) for k in keys]) for n in names}
        self.views, self.slot_views = {}, {}
        start = 0
        for k in keys:
            shape, stop = np.shape(params[k]), start + np.size(params[k])
            self.views[k] = self.var[start:stop].reshape(shape)
            self.slot_views[k] = {n: a[start:stop].reshape(shape) for n, a in self.slots.items()}
            start = stop

    def holds(self, params: dict, slots: dict) -> bool:
        """Whether ``params`` and ``slots`` still hold this group's views (nothing replaced them)."""
        return all(params[k] is self.views[k] and all(slots[k][n] is v for n, v in self.slot_views[k].items())
                   for k in self.keys)


class FusedUpdates:
    """The fused part of a numpy rule's updates (module doc): a mixin of
    ``optimizers.NumpyOptimizer`` (it uses the rule's ``slots``, ``slot_names``, ``weight_decay``,
    ``no_decay``, its copy-on-write and update-ahead records, ``_fused`` (a dict it keeps its buffers
    in), ``_decay`` and ``_update_blocked``).
    Off unless ``fuse_small`` is set by the variables' holder, and for a rule without slots."""

    fuse_small = False   # the holder's choice: an all-reduce channel and a parameter server set it

    def _apply_fused(self, iteration: int, params: dict, grads: dict) -> dict:
        """Update, together, the small dense variables of ``grads`` that may be updated in place (no
        update ahead, no live snapshot: a pull still being sent reads it); return the gradients of
        the others, for the per-variable path."""
        if not self.slot_names:   # a rule of one pass (plain SGD): joining the gradients costs more than it saves
            return grads
        picked: dict = {}
        for key, grad in grads.items():
            var = params[key]
            if (type(grad) is np.ndarray and grad.size <= SMALL_VALUES and grad.dtype == var.dtype
                    and np.shape(grad) == np.shape(var) and key not in self._ahead
                    and not any(r() is not None for r in self._readers.get(key, ()))):
                decays = self.weight_decay is not None and key[0] not in self.no_decay
                picked.setdefault((var.dtype.str, decays), []).append(key)
        rest = dict(grads)
        for (dtype, decays), keys in picked.items():
            if len(keys) < MIN_FUSED:
                continue
            group = self._fused_group((dtype, decays, tuple(keys)), params)
            g = np.concatenate([np.ravel(grads[k]) for k in keys])
            for k in keys:
                self._readers.pop(k, None)
                del rest[k]
            if decays:
                self._decay(group.var, keys[0])
            g2 = np.square(g) if self.squares_slices else None
            self._update_blocked(iteration, None, group.var, None, g, g2, slots=group.slots)
        return rest

    def _fused_group(self, index: tuple, params: dict) -> _Group:
        groups = self._fused   # (dtype, decays, keys) -> _Group
        group = groups.get(index)
        if group is not None and group.holds(params, self.slots):
            return group
        keys = set(index[2])
        for old in [i for i, g in groups.items() if keys.intersection(g.keys)]:   # its views are replaced
            del groups[old]
        group = groups[index] = _Group(index[2], params, self.slots, self.slot_names)
        for k in group.keys:
            params[k] = group.views[k]
            self.slots[k] = dict(group.slot_views[k])
            self._owned[k] = weakref.ref(group.views[k])   # its own: later updates write in place
        return group
