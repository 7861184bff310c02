"""The parameter-server shard actor: holds variable shards and their optimizer state.

With the numpy optimizer rules (``optimizers``) it runs no TensorFlow, so a fresh one starts in a
fraction of a second; any other optimizer configuration runs the Keras optimizer itself
(``keras_optimizer``), which imports TensorFlow on the first update (seconds). It is an
asyncio Ray actor: ``pull`` may wait for a version without blocking ``push`` calls.

Protocol, per worker and step ``t`` (one call each, whatever the number of shards held):
    ``push(worker, t, grads)``  grads: key -> dense ndarray, or for a sparse shard
                                ``(rows, values)`` or ``(rows, values, positions, square_sums)``
                                (repeated rows summed by the sender; see ``slices.dedup_rows``);
    ``pull(min_version, rows)`` waits until ``version >= min_version``, returns the values: whole
                                shards, except the keys in ``rows`` (key -> shard-local row ids),
                                for which only those rows are returned, in that order.

A synchronous PS worker's pull may name itself and its step (``asker``); the actor then keeps the
rows it asked for, and that worker's push of the same step may send a sparse shard as ``(None,
values, ...)``: values laid out on those rows (``slices.dedup_aligned``). So a step's row ids cross the
network once, with the pull. Rows kept for a step whose push never used them (a variable without
gradient) are dropped once every worker's push of that step is applied.

Sparse shards move rows, never tables; the update is the full Keras one (Adam's moments decay on
every row), its rows without gradient computed as a step's first push arrives (``update_ahead``).

``version`` counts applied updates. Synchronous mode sums the pushes of step ``t`` from all
workers, in the order of their sources whatever order they arrive in (``ordered_sum``: the same
bits every run), and, once all are in and every earlier step is applied, applies their mean as update
``t`` (so ``version == t + 1`` afterwards).

Pipelining (synchronous mode): the keys may be split into ``chunks`` (groups of keys; by default
one group of all keys). A worker then pushes and pulls each chunk in its own call
(``push(..., chunk=c)``, ``pull(..., chunk=c)``), every chunk has its own version and is applied
as soon as all workers' gradients of that chunk are in, so the pull of an applied chunk crosses
the network while the pushes of the others are still in flight, and no chunk waits for another.
``version`` is then the least version of all chunks. A worker computing step ``t`` pulls with
``min_version = t - staleness``: with staleness 0 it always sees exactly version ``t``, which is
single-process training on the global batch. Asynchronous mode applies every push on arrival.
"""
from __future__ import annotations

import asyncio
import os
import sys
import time

import numpy as np

from autosync.runtime import timeline
from autosync.runtime.initial import initial_slice
from autosync.runtime.ordered_sum import OrderedSums
from autosync.runtime.tf_arrays import aligned_empty
from autosync.runtime.ps_checkpoint import Checkpointed
from autosync.runtime.ps_clip import HeldSteps
from autosync.runtime.ps_pool import PooledShard
from autosync.runtime.rows import received_grad
from autosync.runtime.slices import merge_rows


class ParameterServerShard(Checkpointed, HeldSteps, PooledShard):
    """State and update logic of one PS actor (wrapped with ``ray.remote`` by the runtime; made
    with no arguments, it holds nothing until ``reset``: see ``ps_pool``).

    Args:
        name: for messages (``ps@node1``).
        values: key -> initial value of each shard it holds.
        sparse_keys: keys whose gradients arrive as ``(indices, values)``.
        shared_keys: keys pulled with local replication (one object per version, shared by the
            workers of a node through its object store).
        optimizer_config: the Keras optimizer's ``get_config()``.
        num_workers: pushes per step in synchronous mode.
        sync: synchronous (True) or asynchronous PS.
        chunks: the keys split into groups updated and served separately (see the module doc);
            None: one group of all keys.
        description: a worker's ``load`` description with its ``initial`` values (the runtime passes
            the pool's copy in the object store); given, ``values`` maps each key to
            ``(var_index, start, stop, axis)`` and the shard starts from that slice of the initial
            values: a view of the object store, not a copy (a slice along axis 0 is contiguous), or
            for a ``ZeroInitial`` zeros allocated here, which updates write in place from the start.
    """

    def __init__(self, *args, **kwargs):
        self.name = ""
        self._server = None   # psnet.Server once ``listen`` is called
        self._error: str | None = None
        self.keras_ready = False   # whether this session's shards were set up with Keras already imported
        if args or kwargs:
            self._setup(*args, **kwargs)

    def _setup(self, name: str, values: dict, sparse_keys, shared_keys, optimizer_config: dict,
               num_workers: int, sync: bool, chunks=None, description: dict | None = None) -> None:
        from autosync.runtime.optimizers import make_optimizer, sparse_form

        self.keras_ready = "keras" in sys.modules
        self.name = name
        made_here: set = set()
        if description is not None:
            sliced = {k: initial_slice(description["initial"][v], start, stop, axis)
                      for k, (v, start, stop, axis) in values.items()}
            values = {k: value for k, (value, _) in sliced.items()}
            made_here = {k for k, (_, made) in sliced.items() if made}
        # received arrays may be read-only views of the object store; they are kept as they are
        # (no second copy of the tables) until their first update, which writes a copy
        # (``NumpyOptimizer``: it updates in place only arrays it allocated and no live pull reads)
        self.params = dict(values)
        self._shapes = {k: (np.shape(v), np.asarray(v).dtype) for k, v in values.items()}
        self.sparse_keys = frozenset(sparse_keys)
        self.shared_keys = frozenset(shared_keys)
        self.optimizer = make_optimizer(optimizer_config)
        self.optimizer.fuse_small = True   # small dense shards in one pass of the rule (``fused``)
        self._dense_rule = sparse_form(optimizer_config) == "dense"   # rows summed over the workers in ``_apply``
        for key, value in self.params.items():
            self.optimizer.add_variable(key, value)
            if key in made_here:
                self.optimizer.adopt(self.params, key)
        self.num_workers, self.sync = num_workers, sync
        self._setup_clip(optimizer_config)   # global_clipnorm: held steps (``ps_clip``)
        self.version = 0
        self._pending: dict[int, dict] = {}
        self._orders: dict = {}   # key -> the order its pushes are added in (``ordered_sum``)
        self._error, self._cond = None, None   # a failed update's message; the condition pulls wait on
        self._shared: dict = {}  # keys -> (chunk versions, ObjectRef of their values)
        self.chunks = [tuple(tuple(k) for k in c) for c in chunks] if chunks else [tuple(self.params)]
        if sorted(k for c in self.chunks for k in c) != sorted(self.params):
            raise ValueError(f"{name}: chunks {self.chunks} do not split its keys {sorted(self.params)} exactly")
        if len(self.chunks) > 1 and not sync:
            raise ValueError(f"{name}: an asynchronous PS applies each push as it comes; it takes no chunks")
        # per chunk: the kinds of keys it holds; its step is complete once each kind has all workers' gradients
        self.chunk_kinds = [self._kinds_of(c) for c in self.chunks]
        self.kinds = self._kinds_of(tuple(self.params))
        self.chunk_version = [0] * len(self.chunks)
        self._chunk_of = {k: c for c, keys in enumerate(self.chunks) for k in keys}
        self._asked: dict[tuple, dict] = {}  # (worker, step) -> {key: rows that worker pulled for it}
        self._staged = ({}, {})   # a restore's values and slots sent so far (``Checkpointed``)
        self._first_push: dict[int, float] = {}  # step -> time of its first push (any chunk)
        self._last_push: dict[int, float] = {}
        self.stats_ = {"pushes": 0, "pulls": 0, "data_plane_calls": 0, "apply_s": 0.0, "wait_s": 0.0, "chunks": len(self.chunks),
                       "chunk_wait_s": [0.0] * len(self.chunks)}

    def _kinds_of(self, keys) -> tuple:
        return tuple(k for k, has in (("direct", set(keys) - self.shared_keys),
                                      ("shared", set(keys) & self.shared_keys)) if has)

    def _condition(self) -> asyncio.Condition:
        # created inside the actor's event loop, on first use
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def ready(self) -> dict:
        """Where this actor runs (for placement checks) and ``keras_ready``: whether Keras was
        already imported when its shards were set up (a pooled actor's earlier session or
        ``preload`` imported it)."""
        import ray

        return {"name": self.name, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "keras_ready": self.keras_ready}

    async def listen(self) -> str:
        """Serve ``push`` and ``pull`` on the PS data plane (``psnet``); returns the endpoint the
        workers connect to."""
        from autosync.runtime.psnet import Server, node_address

        if self._server is None:
            self._server = Server(self._serve, node_address())
        return self._server.endpoint

    async def _serve(self, method: str, args: tuple):
        self.stats_["data_plane_calls"] += 1
        if method in ("push", "pull", "clip_norm", "clip_scale"):
            return await getattr(self, method)(*args)
        raise ValueError(f"{self.name}: the PS data plane serves push, pull, clip_norm and clip_scale, not {method!r}")

    async def push(self, source, step: int, grads: dict, weight: int = 1, kinds=None, chunk=None) -> None:
        """Receive gradient shards for ``step`` (all keys of this actor a source sends, at once).

        Args:
            source: the sending worker's index, or the node name of a node aggregator.
            step: the step the gradients belong to.
            grads: key -> gradient (see the module doc).
            weight: how many workers' gradients ``grads`` sums (a node aggregator's: its workers).
            kinds: which of this actor's key kinds the push covers: ``direct`` (keys pulled by each
                worker) and/or ``shared`` (locally replicated keys); default both it holds.
            chunk: the one chunk the push covers (its keys only); None: all chunks.
        """
        if self._error:
            raise RuntimeError(self._error)
        self.stats_["pushes"] += 1
        t0 = time.perf_counter()
        try:
            grads = self._with_rows(source, step, grads)
            if self.sync:
                self._accumulate(source, step, grads, weight, tuple(kinds or self.kinds), chunk)
                applied = self._apply_complete_steps()
            else:
                self.optimizer.apply(self.version, self.params, self._own(grads))
                self.version += 1
                applied = True
        except Exception as e:  # reported to every waiting pull, then re-raised
            self._error = f"{self.name}: update for step {step} from worker {source} failed: {type(e).__name__}: {e}"
            applied = True
            raise
        finally:
            timeline.add("push", t0, time.perf_counter(), step=step, source=source, chunk=chunk)
            if applied or self.holds:   # held steps: a clip_norm may wait for this push
                async with self._condition():
                    self._condition().notify_all()

    async def timeline(self, record: bool) -> dict | None:
        """Start recording this actor's timeline, or stop and return it (``timeline.toggle``)."""
        return timeline.toggle(record)

    async def stats(self) -> dict:
        """Calls received and time spent: ``pushes``, ``pulls`` (``data_plane_calls`` of all calls
        came over the PS data plane, ``psnet``; the others through Ray), ``apply_s`` (optimizer updates)
        ``wait_s`` (per step, from its first push to its last: how long the step waited for its
        slowest sender), ``chunks`` and ``chunk_wait_s`` (per chunk, summed over steps: from the
        chunk's first push to its last), ``copies`` (variables copied before an update: each
        received value once, then only while a whole-value pull of it was still being sent; a
        variable updated ahead, its second arrays), ``ahead`` (updates finished from one ahead),
        ``compiled`` and ``xla_fallbacks`` (the Keras path's updates run compiled by XLA, and chunks
        XLA could not compile: ``keras_update.ChunkUpdates``; 0 for the numpy rules)."""
        return {**self.stats_, "copies": self.optimizer.copies, "ahead": self.optimizer.ahead,
                "compiled": getattr(getattr(self.optimizer, "updates", None), "compiled", 0),
                "xla_fallbacks": getattr(getattr(self.optimizer, "updates", None), "xla_fallbacks", 0)}

    async def pull(self, min_version: int, rows: dict | None = None, which: str = "all", chunk=None,
                   asker: tuple | None = None):
        """Current values once ``version >= min_version``.

        Args:
            min_version: the update count to wait for.
            rows: sparse key -> shard-local row ids: only those rows of that shard are returned
                (a copy, in the order given); other keys are returned whole.
            which: ``all`` keys, only the ``direct`` ones (not locally replicated), or only the
                ``shared`` ones (a node aggregator's pull, returned directly).
            chunk: only that chunk's keys, once that chunk's version is ``>= min_version``;
                None: every key, once every chunk is.
            asker: ``(worker, step)``: keep the sparse ``rows`` for that worker's push of that step
                (synchronous PS; see the module doc).

        Returns:
            ``(version, direct, shared_ref)``: ``direct`` maps keys to arrays; ``shared_ref`` is an
            ObjectRef to a dict of the locally replicated keys not pulled by rows (None if none).
        """
        if asker is not None and rows:
            kept = {k: np.asarray(v) for k, v in rows.items() if k in self.sparse_keys and len(v)}
            if kept:
                self._asked.setdefault(tuple(asker), {}).update(kept)
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: self._version(chunk) >= min_version or self._error is not None)
        if self._error:
            raise RuntimeError(self._error)
        self.stats_["pulls"] += 1
        with timeline.span("serve pull", step=self._version(chunk), chunk=chunk, asker=asker):
            return self._serve_pull(chunk, rows, which)

    def _serve_pull(self, chunk, rows, which: str):
        if self.sync:
            # every push of a step before ``version`` is applied: rows kept for them are unused
            for old in [a for a in self._asked if a[1] < self.version]:
                del self._asked[old]
        version = self._version(chunk)
        rows = rows or {}
        keys = tuple(self.params if chunk is None else self.chunks[chunk])
        # rows are gathered (a copy); a whole value is a snapshot no later update writes into
        # (Ray serializes the reply after this coroutine returns, on another thread, while later
        # pushes may already run on this event loop)
        wanted = [k for k in keys if k in rows or (k in self.shared_keys) == (which == "shared")]
        read = self.optimizer.gather(self.params, {k: rows[k] for k in wanted if k in rows})
        read.update(self.optimizer.snapshots(self.params, [k for k in wanted if k not in rows]))
        if which == "shared":
            return version, {k: read[k] for k in keys if k in self.shared_keys}, None
        direct = {k: read[k] for k in keys if k in rows or k not in self.shared_keys}
        if which == "direct":
            direct = {k: v for k, v in direct.items() if k not in self.shared_keys}
            return version, direct, None
        return version, direct, self._shared_snapshot(frozenset(keys) & self.shared_keys - set(rows))

    def _version(self, chunk) -> int:
        return self.version if chunk is None else self.chunk_version[chunk]

    async def finalize(self) -> None:
        """End of training under ``use_ema``: every shard takes its moving average."""
        self.optimizer.finalize(self.params)
        self._shared = {}   # a locally replicated snapshot of the same version is out of date now

    async def values(self) -> dict:
        """All shards now (for tests and final weights): snapshots no later update changes."""
        return {k: self.optimizer.snapshot(self.params, k) for k in self.params}

    def _shared_snapshot(self, keys: frozenset):
        if not keys:
            return None
        version = (self.version, tuple(self.chunk_version))
        cached = self._shared.get(keys)
        if cached is None or cached[0] != version:
            import ray

            # one object per version: workers of a node read the same copy from their store
            # (``ray.put`` copies the values into the store before it returns)
            cached = self._shared[keys] = (version, ray.put({k: self.optimizer.value(self.params, k) for k in keys}))
        return cached[1]

    def _with_rows(self, source, step: int, grads: dict) -> dict:
        """``grads`` with the rows of each ``(None, values, ...)`` sparse shard filled in from what
        ``source`` pulled for ``step`` (those rows are then forgotten)."""
        if not any(isinstance(g, tuple) and g[0] is None for g in grads.values()):
            return grads
        asked = self._asked.get((source, step), {})
        out = dict(grads)
        for key, g in grads.items():
            if isinstance(g, tuple) and g[0] is None:
                if key not in asked:
                    raise RuntimeError(f"{self.name}: worker {source} pushed {key} for step {step} without its rows, "
                                       f"but pulled no rows of it for that step")
                out[key] = (asked.pop(key),) + tuple(g[1:])
        if not asked:
            self._asked.pop((source, step), None)
        return out

    def _own(self, grads: dict) -> dict:
        out = {}
        for key, g in grads.items():
            if key not in self.params:
                raise KeyError(f"{self.name} holds no shard {key}; it holds {sorted(self.params)}")
            out[key] = received_grad(key, g, *self._shapes[key], key in self.sparse_keys)
        return out

    def _accumulate(self, source, step: int, grads: dict, weight: int, kinds: tuple, chunk) -> None:
        covered = range(len(self.chunks)) if chunk is None else (chunk,)
        now = time.perf_counter()
        self._first_push.setdefault(step, now)
        self._last_push[step] = now
        own = self._own(grads)
        for c in covered:
            if step < self.chunk_version[c]:
                raise RuntimeError(f"worker {source} pushed step {step} but step {self.chunk_version[c] - 1} "
                                   f"is already applied")
            entry = self._pending.setdefault((step, c), {"sources": set(), "first": now,
                                                         "sums": OrderedSums(self._orders),
                                                         "weight": dict.fromkeys(self.chunk_kinds[c], 0)})
            for kind in kinds:
                if kind not in entry["weight"]:
                    continue
                if (source, kind) in entry["sources"]:
                    raise RuntimeError(f"worker {source} pushed step {step} twice")
                entry["sources"].add((source, kind))
                entry["weight"][kind] += weight
            entry["last"] = now
        for key, g in own.items():
            c = self._chunk_of[key]
            if c not in covered:
                raise RuntimeError(f"{self.name}: a push for chunk {chunk} holds key {key} of chunk {c}")
            # summed in the order of the sources, not of arrival (``ordered_sum``)
            sums = self._pending[(step, c)]["sums"]
            if key in self.sparse_keys:
                sums.add_slices(key, source, g)
            else:
                sums.add(key, source, g)
        for c in covered:
            entry = self._pending[(step, c)]
            if min(entry["weight"].values()) == self.num_workers:   # every push is in: what updates read
                entry["dense"], entry["sparse"] = entry.pop("sums").settle()
            elif step == self.chunk_version[c]:   # a step waiting for more pushes: its update is computed ahead
                self.optimizer.update_ahead(self._iteration(step), self.params,
                                            [k for k in self.chunks[c] if k in self.sparse_keys])

    def _apply_complete_steps(self) -> bool:
        applied = False
        for c in range(len(self.chunks)):
            while (self.chunk_version[c], c) in self._pending and not self._held(self.chunk_version[c]) and all(
                    w == self.num_workers for w in self._pending[(self.chunk_version[c], c)]["weight"].values()):
                step = self.chunk_version[c]
                entry = self._pending.pop((step, c))
                self.stats_["chunk_wait_s"][c] += entry["last"] - entry["first"]
                timeline.add("pushes in", entry["first"], entry["last"], step=step, chunk=c)
                with timeline.span("apply", step=step, chunk=c):
                    self._apply(step, entry)
                self.chunk_version[c] += 1
                applied = True
        while self.version < min(self.chunk_version):
            # the step is applied in every chunk: how long it waited between its first and last push
            self.stats_["wait_s"] += self._last_push.pop(self.version) - self._first_push.pop(self.version)
            self._clip_applied(self.version)
            self.version += 1
        return applied

    def _apply(self, step: int, entry: dict) -> None:
        if self._skips(step):   # dynamic loss scaling: a gradient was not finite, nothing changes
            return
        t0 = time.perf_counter()
        n = self.num_workers
        scale = self._clip_factor(step)   # global_clipnorm's (``ps_clip``), or None
        grads: dict = {}
        for key, total in entry["dense"].items():
            total /= total.dtype.type(n)  # the step's own sum (``OrderedSums`` copied it)
            if scale is not None:
                total *= total.dtype.type(scale)
            grads[key] = total
        for key, parts in entry["sparse"].items():
            if scale is None and not self._dense_rule:
                idx, vals = _concatenate([p[0] for p in parts]), _concatenate([p[1] for p in parts])
            else:   # Keras hands the rule a dense gradient (global_clipnorm, accumulation): rows summed
                idx, vals = merge_rows([(p[0], p[1]) for p in parts], False)
                parts = [(idx, vals, None)]
            vals /= vals.dtype.type(n)
            squares = None
            if any(p[2] is not None for p in parts):
                squares = _concatenate([np.square(p[1]) if p[2] is None else p[2] for p in parts])
                squares /= squares.dtype.type(n * n)
            if scale is not None:
                vals *= vals.dtype.type(scale)
                squares = None if squares is None else squares * squares.dtype.type(scale * scale)
            grads[key] = (idx, vals, squares)
        self.optimizer.apply(self._iteration(step), self.params, grads)
        self.stats_["apply_s"] += time.perf_counter() - t0


def _concatenate(parts: list) -> np.ndarray:
    """``np.concatenate(parts)`` into a new array as ``aligned_copy`` makes it."""
    parts = [np.asarray(p) for p in parts]
    out = aligned_empty((sum(len(p) for p in parts),) + parts[0].shape[1:], np.result_type(*parts))
    return np.concatenate(parts, out=out)
