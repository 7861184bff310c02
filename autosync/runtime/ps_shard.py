"""The parameter-server shard actor: holds variable shards and their optimizer state.

It runs numpy only (no TensorFlow), so a fresh one starts in a fraction of a second. It is an
asyncio Ray actor: ``pull`` may wait for a version without blocking ``push`` calls.

Protocol, per worker and step ``t`` (one call each, whatever the number of shards held):
    ``push(worker, t, grads)``  grads: key -> dense ndarray, or for a sparse shard
                                ``(rows, values)`` or ``(rows, values, positions, square_sums)``
                                (repeated rows summed by the sender; see ``rows.dedup_rows``);
    ``pull(min_version, rows)`` waits until ``version >= min_version``, returns the values: whole
                                shards, except the keys in ``rows`` (key -> shard-local row ids),
                                for which only those rows are returned, in that order.

Sparse shards move rows, never tables, in both directions; the optimizer update itself is the
full Keras one (Adam's moments decay on every row), applied here.

``version`` counts applied updates. Synchronous mode sums the pushes of step ``t`` from all
workers and, once all are in and every earlier step is applied, applies their mean as update
``t`` (so ``version == t + 1`` afterwards). A worker computing step ``t`` pulls with
``min_version = t - staleness``: with staleness 0 it always sees exactly version ``t``, which is
single-process training on the global batch. Asynchronous mode applies every push on arrival.
"""
from __future__ import annotations

import asyncio
import os

import numpy as np


class ParameterServerShard:
    """State and update logic of one PS actor (wrapped with ``ray.remote`` by the runtime).

    Args:
        name: for messages (``ps@node1``).
        values: key -> initial value of each shard it holds.
        sparse_keys: keys whose gradients arrive as ``(indices, values)``.
        shared_keys: keys pulled with local replication (one object per version, shared by the
            workers of a node through its object store).
        optimizer_config: the Keras optimizer's ``get_config()``.
        num_workers: pushes per step in synchronous mode.
        sync: synchronous (True) or asynchronous PS.
    """

    def __init__(self, name: str, values: dict, sparse_keys, shared_keys, optimizer_config: dict,
                 num_workers: int, sync: bool):
        from autosync.runtime.optimizers import make_optimizer

        self.name = name
        # received arrays may be read-only views of the object store: own a copy
        self.params = {k: np.array(v) for k, v in values.items()}
        self.sparse_keys = frozenset(sparse_keys)
        self.shared_keys = frozenset(shared_keys)
        self.optimizer = make_optimizer(optimizer_config)
        for key, value in self.params.items():
            self.optimizer.add_variable(key, value)
        self.num_workers = num_workers
        self.sync = sync
        self.version = 0
        self._pending: dict[int, dict] = {}
        self._error: str | None = None
        self._cond: asyncio.Condition | None = None
        self._shared_ref = None
        self._shared_version: tuple | None = None

    def _condition(self) -> asyncio.Condition:
        # created inside the actor's event loop, on first use
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def ready(self) -> dict:
        """Where this actor runs (for placement checks)."""
        import ray

        return {"name": self.name, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    async def push(self, worker: int, step: int, grads: dict) -> None:
        """Receive one worker's gradient shards for ``step`` (all keys of this actor at once)."""
        if self._error:
            raise RuntimeError(self._error)
        try:
            if self.sync:
                self._accumulate(worker, step, grads)
                applied = self._apply_complete_steps()
            else:
                self.optimizer.apply(self.version, self.params, self._own(grads))
                self.version += 1
                applied = True
        except Exception as e:  # reported to every waiting pull, then re-raised
            self._error = f"{self.name}: update for step {step} from worker {worker} failed: {type(e).__name__}: {e}"
            applied = True
            raise
        finally:
            if applied:
                async with self._condition():
                    self._condition().notify_all()

    async def pull(self, min_version: int, rows: dict | None = None):
        """Current values once ``version >= min_version``.

        Args:
            min_version: the update count to wait for.
            rows: sparse key -> shard-local row ids: only those rows of that shard are returned
                (a copy, in the order given); other keys are returned whole.

        Returns:
            ``(version, direct, shared_ref)``: ``direct`` maps keys to arrays; ``shared_ref`` is an
            ObjectRef to a dict of the locally replicated keys not pulled by rows (None if none).
        """
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: self.version >= min_version or self._error is not None)
        if self._error:
            raise RuntimeError(self._error)
        rows = rows or {}
        direct = {k: v[rows[k]] if k in rows else v for k, v in self.params.items()
                  if k in rows or k not in self.shared_keys}
        return self.version, direct, self._shared_snapshot(self.shared_keys - set(rows))

    async def values(self) -> dict:
        """All shards now (for tests and final weights)."""
        return dict(self.params)

    def _shared_snapshot(self, keys: frozenset):
        if not keys:
            return None
        if self._shared_version != (self.version, keys):
            import ray

            # one object per version: workers of a node read the same copy from their store
            self._shared_ref = ray.put({k: self.params[k] for k in keys})
            self._shared_version = (self.version, keys)
        return self._shared_ref

    def _own(self, grads: dict) -> dict:
        out = {}
        for key, g in grads.items():
            if key not in self.params:
                raise KeyError(f"{self.name} holds no shard {key}; it holds {sorted(self.params)}")
            out[key] = _sparse_grad(g) if key in self.sparse_keys else np.asarray(g)
        return out

    def _accumulate(self, worker: int, step: int, grads: dict) -> None:
        if step < self.version:
            raise RuntimeError(f"worker {worker} pushed step {step} but step {self.version - 1} is already applied")
        entry = self._pending.setdefault(step, {"workers": set(), "dense": {}, "sparse": {}})
        if worker in entry["workers"]:
            raise RuntimeError(f"worker {worker} pushed step {step} twice")
        entry["workers"].add(worker)
        for key, g in self._own(grads).items():
            if key in self.sparse_keys:
                entry["sparse"].setdefault(key, []).append(g)
            elif key in entry["dense"]:
                entry["dense"][key] += g
            else:
                entry["dense"][key] = np.array(g)  # own, writable copy to accumulate into

    def _apply_complete_steps(self) -> bool:
        applied = False
        while len(self._pending.get(self.version, {}).get("workers", ())) == self.num_workers:
            entry = self._pending.pop(self.version)
            n = self.num_workers
            grads: dict = {}
            for key, total in entry["dense"].items():
                grads[key] = total / total.dtype.type(n)
            for key, parts in entry["sparse"].items():
                idx = np.concatenate([p[0] for p in parts])
                vals = np.concatenate([p[1] for p in parts])
                squares = None
                if any(p[2] is not None for p in parts):
                    sq = np.concatenate([np.square(p[1]) if p[2] is None else p[2] for p in parts])
                    squares = sq / sq.dtype.type(n * n)
                grads[key] = (idx, vals / vals.dtype.type(n), squares)
            self.optimizer.apply(self.version, self.params, grads)
            self.version += 1
            applied = True
        return applied


def _sparse_grad(g) -> tuple:
    """A pushed sparse gradient as ``(indices, values, squares or None)`` for the optimizer."""
    indices, values = np.asarray(g[0]), np.asarray(g[1])
    if len(g) == 2:
        return indices, values, None
    squares = np.square(values)
    squares[np.asarray(g[2])] = np.asarray(g[3])
    return indices, values, squares
