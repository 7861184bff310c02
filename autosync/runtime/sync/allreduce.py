"""The all-reduce synchronization channel, seen from one worker.

Every worker keeps its own copy of the all-reduced variables (or shards) and their optimizer
state. A step's ``push`` reduces the gradients group by group, in gradient-ready order:

* dense members of a group that share (backend, compressor) are packed into one flat buffer —
  pre-divided by the number of workers, so the sum is the mean — compressed, reduced with ONE
  collective call, decompressed and unpacked (PowerSGD: one call for the P matrices plus the
  uncompressible members, one for the Q matrices);
* sparse members are all-gathered as (indices, values), exactly what TensorFlow does for
  ``IndexedSlices`` under all-reduce (duplicates add up when applied): one exchange for all of a
  group's sparse members, row ids in the narrowest integer dtype (``sparse_frame``);

then applies the local optimizer (the same numpy Keras rules the parameter servers use), so every
worker holds identical values. ``pull`` hands back those values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autosync.runtime import timeline
from autosync.runtime.optimizers import sparse_form, squares_slices
from autosync.runtime.rows import index_dtype
from autosync.runtime.slices import dedup_rows, read_sparse_frame, sparse_frame
from autosync.runtime.sync.allreduce_state import AllReduceCheckpoint
from autosync.runtime.sync.backends import HierarchicalBackend, resolve_backend
from autosync.runtime.sync.base import CollectiveBackend, SyncChannel, shard_gradient
from autosync.runtime.sync.compression import ErrorFeedback, PowerSGDState, elementwise, restore_state, saved_state
from strategy_space.compressor import Compressor, matrix_dims, powersgd_compressible


@dataclass(frozen=True)
class ARMember:
    """One all-reduced variable or shard.

    Attributes:
        key: ``(var_index, shard_index)``.
        start, stop, axis: the shard's slice of the variable (whole variable: 0..dim, axis 0).
        num_shards: shards of the variable.
        sparse: gradient is ``(indices, values)``.
        compressor: the setting, parsed once when the plan is made (``none`` for sparse).
        backend: resolved backend name (``gloo``, ``nccl``, ``objectstore``), or
            ``hierarchical`` (reduce on the node, leaders all-reduce, broadcast on the node).
        in_step: reduced inside the training step where workers have GPUs (``graph``, which
            ``auto`` is there: ``sync.graph``), each collective as soon as its gradients are
            ready; an emulated worker reduces it while its compute runs (``reduce_early``).
    """

    key: tuple[int, int]
    start: int
    stop: int
    axis: int
    num_shards: int
    sparse: bool
    compressor: Compressor
    backend: str
    in_step: bool = False

    def take(self, grad):
        """This member's part of a full-variable gradient."""
        return shard_gradient(grad, self.start, self.stop, self.axis, self.num_shards)


@dataclass(frozen=True)
class ARGroup:
    """One fusion group: members in the order they are packed."""

    group: int
    members: tuple[ARMember, ...]


def split_by(groups: list[ARGroup], layout: list[tuple[int, int]], inside) -> tuple[list[ARGroup], list[ARGroup]]:
    """(groups of the members of variables a step reduces in the graph, groups of the others),
    order kept, empty ones dropped: a variable goes inside when ``inside(member)`` holds for every
    one of its ``layout[v][0]`` shards and, if sparse, it is not split (``sync.graph``)."""
    members: dict[int, list[ARMember]] = {}
    for g in groups:
        for m in g.members:
            members.setdefault(m.key[0], []).append(m)
    whole = {v for v, ms in members.items()
             if len(ms) == layout[v][0] and all(inside(m) for m in ms) and not (ms[0].sparse and layout[v][0] > 1)}
    graph, rest = [], []
    for g in groups:
        mine = tuple(m for m in g.members if m.key[0] in whole)
        other = tuple(m for m in g.members if m.key[0] not in whole)
        if mine:
            graph.append(ARGroup(g.group, mine))
        if other:
            rest.append(ARGroup(g.group, other))
    return graph, rest


class AllReduceChannel(AllReduceCheckpoint, SyncChannel):
    """All-reduce synchronization for one worker, through a collective backend.

    Args:
        rank, world: this worker's position and the number of workers.
        groups: fusion groups in gradient-ready order.
        setups: backend name -> what its ``prepare`` returned on the driver.
        values: key -> initial value of every member; or, on a cluster, the object-store reference
            of the worker pool's description (whose ``initial`` holds every variable's initial
            value): each worker then slices its members' values out of its node's copy when it
            first needs them, so the driver never ships the model once per worker (a full-size
            dlrm is 2 GB; at 100 Mbit/s one copy a node took minutes before the first step).
        optimizer_config: the Keras optimizer's ``get_config()``.
        seed: PowerSGD's shared seed.
        backends: collective backends already connected, by the name the members use (ranks in one
            process: ``autosync.runtime.sync.inprocess``); the others connect when first used.
    """

    phase = "allreduce"
    holds_values = True   # a pull reads what this worker holds: no network

    def __init__(self, rank: int, world: int, groups: list[ARGroup], setups: dict, values: dict,
                 optimizer_config: dict, seed: int = 0, backends: dict[str, CollectiveBackend] | None = None):
        self.rank, self.world = rank, world
        self.groups = groups
        self.setups = setups
        self._initial_ref = None if isinstance(values, dict) else values
        self._params = dict(values) if isinstance(values, dict) else None
        self.optimizer_config = optimizer_config
        # Keras hands the rule a dense gradient (``optimizers.sparse_form``): ``_as_read`` sums rows
        self._dense_rule = sparse_form(optimizer_config) == "dense"
        # a row's summed slices give the rule the same update: repeated rows summed before the gather
        self._sum_rows = sparse_form(optimizer_config) == "rows"
        self._squares = squares_slices(optimizer_config)
        self.seed = seed
        self.calls = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self._backends: dict[str, CollectiveBackend] = dict(backends or {})
        self._optimizer = None
        self._ef: dict[Compressor, ErrorFeedback] = {}
        self._powersgd: dict[Compressor, PowerSGDState] = {}
        self._version = 0
        self._held: dict | None = None   # a step's reduced gradients awaiting ``release``
        self._saved: tuple = ({}, {}, [])   # the compressors' memory before the held step (``saved_state``)
        self._early: tuple[int, set, dict] = (-1, set(), {})   # (step, groups, reduced) by ``reduce_early``
        self._members = {m.key: m for g in groups for m in g.members}
        self.carries = frozenset(m.key[0] for g in groups for m in g.members)

    def __getstate__(self):
        # shipped to the worker before first use: connections are made there, lazily
        state = dict(self.__dict__)
        state["_backends"] = {}
        return state

    @property
    def params(self) -> dict:
        """key -> this worker's current value of every member."""
        if self._params is None:
            import ray

            from autosync.runtime.initial import initial_slice

            # read-only views where a slice allows (the optimizer copies before it writes)
            initial = ray.get(self._initial_ref)["initial"]
            self._params = {m.key: initial_slice(initial[m.key[0]], m.start, m.stop, m.axis)[0]
                            for g in self.groups for m in g.members}
        return self._params

    @params.setter
    def params(self, value: dict) -> None:
        self._params = value

    # ---- SyncChannel -------------------------------------------------------------------
    def pull(self, step: int, fresh: bool = False, rows: dict | None = None) -> dict[tuple[int, int], np.ndarray]:
        """Values per (var, shard): every worker applied the same reduced gradients and holds
        them here. A variable in ``rows`` (what the step reads of a row-read table) comes as
        ``(row ids, those rows)``, its ids within the shard's bounds, as a parameter server sends
        rows: the worker writes only those into its model, not the whole table every step (an
        update rule that moves every row, as Adam's does, would otherwise cost a full copy of
        each table a step); the rest whole."""
        params = self.params
        rows = rows or {}
        out, wanted = {}, {}
        for key in params:
            m = self._members[key]
            if m.sparse and key[0] in rows and m.axis == 0:
                ids = np.asarray(rows[key[0]], dtype=np.int64)
                if m.num_shards > 1:
                    ids = ids[(ids >= m.start) & (ids < m.stop)]
                wanted[key] = ids
            elif self._optimizer is None:
                out[key] = params[key]
            else:
                out[key] = self._optimizer.value(params, key)
        if wanted:
            local = {k: ids - self._members[k].start for k, ids in wanted.items()}
            got = (self._optimizer.gather(params, local) if self._optimizer is not None
                   else {k: params[k][i] for k, i in local.items()})
            out.update({k: (wanted[k], got[k]) for k in wanted})
        return out

    def push(self, step: int, grads: list) -> None:
        self._update(self._as_read(self._reduce_rest(step, grads)))

    def reduce_early(self, step: int, grads: list, index: int) -> None:
        """Reduce ``groups[index]`` of this step before ``push``, which reduces the other groups
        and applies them all in one update: an emulated worker's collectives of ``in_step``
        members, issued while its compute still runs (``emulated``)."""
        if self._early[0] != step:
            self._early = (step, set(), {})
        self._early[2].update(self.reduce(step, grads, (index,)))
        self._early[1].add(index)

    def _reduce_rest(self, step: int, grads: list, sum_rows: bool = True) -> dict:
        """This step's reduced gradients: those ``reduce_early`` reduced, and the other groups'."""
        done, early = self._early[1:] if self._early[0] == step else (set(), {})
        self._early = (-1, set(), {})
        rest = [i for i in range(len(self.groups)) if i not in done]
        return {**early, **self.reduce(step, grads, rest, sum_rows)}

    def _as_read(self, reduced: dict) -> dict:
        """The reduced gradients in the form the update rule reads them: a sparse member's gathered
        slices summed row by row where Keras hands the rule a dense gradient (``global_clipnorm``,
        gradient accumulation: ``optimizers.sparse_form``), as they are otherwise."""
        if not self._dense_rule:
            return reduced
        return {k: dedup_rows(g[0], g[1], False) if isinstance(g, tuple) else g for k, g in reduced.items()}

    def push_held(self, step: int, grads: list) -> dict:
        """The reduced gradients, kept for ``release`` (``base``'s held steps): every sparse slice
        as it is (the norm squares each one, as Keras does)."""
        self._saved = saved_state(self._ef, self._powersgd)   # put back if the step is skipped
        self._held = self._reduce_rest(step, grads, sum_rows=False)
        return self._held

    def held_sq(self, held: dict) -> float:
        """The squared norm of the reduced gradients (a sparse member's gathered slices each
        squared, as Keras squares ``IndexedSlices`` values; under gradient accumulation Keras
        clips the dense sum, repeated rows added first): the same on every worker."""
        dense = (self.optimizer_config.get("gradient_accumulation_steps") or 1) > 1
        return sum(float(np.sum(np.square((dedup_rows(g[0], g[1], False)[1] if dense else g[1])
                                          if isinstance(g, tuple) else g, dtype=np.float64)))
                   for g in held.values())

    def release(self, step: int, scale, iteration: int | None = None) -> None:
        held, self._held = self._held, None
        if scale is None:   # skipped (dynamic loss scaling): no update, the optimizer's count stays, and
            restore_state(self._ef, self._powersgd, self._saved)   # the compressors' memory as it was
            return
        if iteration is not None:
            self._version = iteration   # the optimizer's count of updates (steps skipped before)
        s = np.float32(scale)
        held = self._as_read(held)   # global_clipnorm: Keras hands the rule a dense gradient
        self._update({k: (g[0], g[1] * s) if isinstance(g, tuple) else g * s for k, g in held.items()})

    def finalize(self) -> None:
        if self._optimizer is not None:
            self._optimizer.finalize(self.params)

    def _update(self, reduced: dict) -> None:
        if self._optimizer is None:
            from autosync.runtime.optimizers import make_optimizer

            self._optimizer = make_optimizer(self.optimizer_config)
            self._optimizer.fuse_small = True   # small dense members in one pass of the rule (``fused``)
            for key, value in self.params.items():
                self._optimizer.add_variable(key, value)
        with timeline.span("update"):
            self._optimizer.apply(self._version, self.params, reduced)
        self._version += 1

    def reduce(self, step: int, grads: list, indices=None, sum_rows: bool = True) -> dict:
        """The mean over workers of every member's gradient, as this step's collectives deliver it
        (compressed where the member's compressor says): key -> dense array, or (indices, values)
        for a sparse member (with ``sum_rows``, its rows summed where the rule allows:
        ``_gather_sparse``); only the groups at ``indices`` of ``groups`` where given. ``push``
        applies it; alone it is the synchronization without an update
        (``benchmarks/accelerator_efficiency.py`` trains on it with the model's framework)."""
        reduced: dict = {}
        for g in self.groups if indices is None else [self.groups[i] for i in indices]:
            members = [m for m in g.members if grads[m.key[0]] is not None]
            by_kind: dict[tuple[str, str], list[ARMember]] = {}
            for m in members:
                by_kind.setdefault((m.backend, "sparse" if m.sparse else m.compressor), []).append(m)
            for (backend, comp), ms in by_kind.items():
                tag = f"{step}/{g.group}/{backend}/{comp}"
                parts = [m.take(grads[m.key[0]]) for m in ms]
                if comp == "sparse":
                    reduced.update(self._gather_sparse(backend, ms, parts, tag, sum_rows and self._sum_rows))
                else:
                    reduced.update(self._reduce_dense(backend, comp, ms, parts, tag))
        return reduced

    def finish(self) -> None:
        """Collectives are synchronous: nothing is outstanding."""

    # ---- internals ---------------------------------------------------------------------
    def _backend(self, name: str) -> CollectiveBackend:
        b = self._backends.get(name)
        if b is None:
            cls = HierarchicalBackend if name == "hierarchical" else resolve_backend(name, gpus=False)
            b = cls.connect(self.rank, self.world, self.setups[name])
            self._backends[name] = b
        return b

    def _allreduce(self, backend: str, buf: np.ndarray, tag: str) -> np.ndarray:
        self.calls += 1
        self.bytes_sent += buf.nbytes
        self.bytes_received += buf.nbytes
        with timeline.span("collective", tag=tag, bytes=int(buf.nbytes)):
            return self._backend(backend).allreduce(buf, tag)

    def _reduce_dense(self, backend, comp, ms, parts, tag) -> dict:
        if comp.kind == "powersgd":
            return self._reduce_powersgd(backend, comp, ms, parts, tag)
        compressor, ef = elementwise(comp), comp.error_feedback
        # float32 on the wire (narrower gradients widened), but float64 ones sent uncompressed go as
        # they are, as the cost model counts their bytes: reduced in float32 they trained off one
        # process by float32's rounding
        wide = comp.kind == "none" and any(np.asarray(p).dtype == np.float64 for p in parts)
        dtype = np.float64 if wide else np.float32
        scale = dtype(1.0 / self.world)
        flats = [np.asarray(p, dtype=dtype).ravel() * scale for p in parts]
        if ef:
            memory = self._ef.setdefault(comp, ErrorFeedback())
            flats = [memory.add(m.key, f) for m, f in zip(ms, flats)]
        buf = np.concatenate(flats) if len(flats) > 1 else flats[0]
        wire, ctx = compressor.compress(buf)
        if ef:
            sent = compressor.decompress(wire, ctx)
            offset = 0
            for m, f in zip(ms, flats):
                memory.keep(m.key, f, sent[offset:offset + f.size])
                offset += f.size
        total = compressor.decompress(self._allreduce(backend, wire, tag), ctx)
        return self._unpack(total, ms, parts)

    def _reduce_powersgd(self, backend, comp, ms, parts, tag) -> dict:
        state = self._powersgd.setdefault(comp, PowerSGDState(comp.rank, comp.error_feedback, self.seed))
        scale = np.float32(1.0 / self.world)
        low = [i for i, p in enumerate(parts) if powersgd_compressible(*matrix_dims(p.shape), comp.rank)]
        raw = [i for i in range(len(parts)) if i not in set(low)]
        ps = [state.first_round(ms[i].key, np.asarray(parts[i], dtype=np.float32)) for i in low]
        # round 1: the P matrices and the uncompressible members, one buffer
        buf1 = np.concatenate([p.ravel() for p in ps] + [np.asarray(parts[i], np.float32).ravel() for i in raw]) * scale
        out1 = self._allreduce(backend, buf1, tag + "/p")
        offset, out = 0, {}
        p_hats, qs = [], []
        for i, p in zip(low, ps):
            p_mean = out1[offset:offset + p.size].reshape(p.shape)
            offset += p.size
            p_hat, q = state.second_round(ms[i].key, p_mean)
            p_hats.append(p_hat)
            qs.append(q)
        for i in raw:
            n = np.asarray(parts[i]).size
            out[ms[i].key] = out1[offset:offset + n].reshape(np.shape(parts[i]))
            offset += n
        if low:
            # round 2: the Q matrices
            out2 = self._allreduce(backend, np.concatenate([q.ravel() for q in qs]) * scale, tag + "/q")
            offset = 0
            for i, p_hat, q in zip(low, p_hats, qs):
                q_mean = out2[offset:offset + q.size].reshape(q.shape)
                offset += q.size
                out[ms[i].key] = state.finish(ms[i].key, p_hat, q_mean, np.shape(parts[i]))
        return out

    def _gather_sparse(self, backend, ms, parts, tag, sum_rows: bool) -> dict:
        """All-gather every sparse member of the group in one exchange (``sparse_frame``): each
        worker's row counts, row ids (shard-local, in the narrowest integer dtype that numbers the
        members' rows) and values (members of lower precision widened on the wire, narrowed
        back) in one buffer, whatever the number of members. With ``sum_rows`` (the update rule
        reads a row's summed slices alike: ``sparse_form`` "rows"), each worker sums its repeated rows first, as
        it does for a parameter server (with the summed squared slices where the rule needs them:
        ``squares_slices``); otherwise every slice travels as it is."""
        b = self._backend(backend)
        if sum_rows:
            parts = [dedup_rows(idx, vals, self._squares, index_dtype(m.stop - m.start)) for m, (idx, vals) in zip(ms, parts)]
        squares = sum_rows and self._squares
        frame, layout = sparse_frame(parts, ms, squares)
        self.calls += 1
        self.bytes_sent += frame.nbytes
        with timeline.span("collective", tag=f"{tag}/rows", bytes=int(frame.nbytes)):
            frames = b.allgather(frame, f"{tag}/rows")
        self.bytes_received += sum(f.nbytes for f in frames)
        gathered = [read_sparse_frame(f, layout) for f in frames]
        out, world = {}, self.world
        for k, (m, part) in enumerate(zip(ms, parts)):
            ids = np.concatenate([g[k][0] for g in gathered]).astype(np.int64)
            v = np.concatenate([g[k][1] for g in gathered]).astype(part[1].dtype, copy=False)
            if squares:   # each slice was divided by the workers: its square by their square
                sq = np.concatenate([g[k][2] for g in gathered]).astype(v.dtype, copy=False)
                out[m.key] = (ids, v / v.dtype.type(world), sq / v.dtype.type(world * world))
            else:
                out[m.key] = (ids, v / v.dtype.type(world))
        return out

    @staticmethod
    def _unpack(total: np.ndarray, ms, parts) -> dict:
        out, offset = {}, 0
        for m, p in zip(ms, parts):
            n = math.prod(np.shape(p))   # not np.prod: a few microseconds a variable, every step
            out[m.key] = total[offset:offset + n].reshape(np.shape(p))
            offset += n
        return out
