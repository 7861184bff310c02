"""The node aggregator: the workers of one node push and pull their locally replicated shards
through it, so the node sends one push and one pull per parameter-server actor per step.

One asyncio Ray actor per node that holds several workers (synchronous PS only). A worker's
``push(worker, step, payloads)`` hands over its gradients of the locally replicated shards,
``{ps_index: {key: gradient}}``; once all the node's workers have pushed step ``t`` their
gradients are summed (dense: added; sparse: rows merged, see ``slices.merge_rows``, or every slice
kept for an optimizer that transforms each) and pushed to
each PS actor as one gradient of weight ``len(workers)``. ``pull(worker, step, min_version, rows)``
waits until all the node's workers asked for step ``t``, pulls once from each PS actor (the union
of the rows they read, for row-pulled shards) and hands every worker the same reply:
``{ps_index: {key: array or (shard-local rows, values)}}``.
"""
from __future__ import annotations

import asyncio

import numpy as np

from autosync.runtime.slices import merge_rows


class NodeAggregator:
    """Sums a node's pushes and shares its pulls (wrapped with ``ray.remote`` by the runtime).

    Args:
        node: the node's name (its identity towards the parameter servers).
        workers: how many workers of the node train.
        actors: PS actor handles, in plan order (indices are the ``ps_index`` of the payloads).
        sparse_keys: keys whose gradients are row-sparse.
        squares: the PS optimizer needs the squared slices of repeated rows.
        slices: the PS optimizer transforms each slice (``optimizers.sparse_form``): the workers'
            slices are put together as they are, repeated rows not summed.
    """

    def __init__(self, node: str, workers: int, actors: list, sparse_keys, squares: bool, slices: bool = False):
        self.node = node
        self.workers = workers
        self.actors = actors
        self.sparse_keys = frozenset(tuple(k) for k in sparse_keys)
        self.squares = squares
        self.slices = slices
        self._pushes: dict[int, dict] = {}
        self._pulls: dict[int, dict] = {}
        self.stats_ = {"pushes_out": 0, "pulls_out": 0}

    async def ready(self) -> str:
        return self.node

    async def stats(self) -> dict:
        """PS calls made for the node: ``pushes_out``, ``pulls_out``."""
        return dict(self.stats_)

    async def push(self, worker: int, step: int, payloads: dict) -> None:
        entry = self._pushes.setdefault(step, {})
        if worker in entry:
            raise RuntimeError(f"aggregator {self.node}: worker {worker} pushed step {step} twice")
        entry[worker] = payloads
        if len(entry) < self.workers:
            return
        del self._pushes[step]
        refs = []
        for ps in sorted({a for p in entry.values() for a in p}):
            parts: dict = {}
            for p in (entry[w] for w in sorted(entry)):   # worker order, not arrival: the same bits every run
                for key, g in p.get(ps, {}).items():
                    parts.setdefault(key, []).append(g)
            summed = {key: self._sparse_sum(gs) if key in self.sparse_keys else _add(gs) for key, gs in parts.items()}
            refs.append(self.actors[ps].push.remote(self.node, step, summed, self.workers, ("shared",)))
            self.stats_["pushes_out"] += 1
        await asyncio.gather(*refs)

    def _sparse_sum(self, parts: list) -> tuple:
        """The node's sparse gradient of one shard from its workers' ``(rows, values[, ...])``."""
        if not self.slices:
            return merge_rows(parts, self.squares)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    async def pull(self, worker: int, step: int, min_version: int, rows: dict):
        entry = self._pulls.get(step)
        if entry is None:
            entry = self._pulls[step] = {"rows": [], "min": min_version,
                                         "reply": asyncio.get_running_loop().create_future()}
        entry["rows"].append(rows)
        entry["min"] = max(entry["min"], min_version)
        if len(entry["rows"]) == self.workers:
            del self._pulls[step]
            try:
                entry["reply"].set_result(await self._pull_once(entry["min"], entry["rows"]))
            except Exception as e:  # noqa: BLE001 - every waiting worker gets the error
                entry["reply"].set_exception(e)
        return await entry["reply"]

    async def _pull_once(self, min_version: int, requests: list) -> dict:
        wanted: dict = {}
        for req in requests:
            for ps, keys in req.items():
                wanted.setdefault(ps, {})
                for key, ids in keys.items():
                    wanted[ps].setdefault(key, []).append(ids)
        union = {ps: {key: np.unique(np.concatenate(ids)) for key, ids in keys.items()}
                 for ps, keys in wanted.items()}
        order = sorted(union)
        replies = await asyncio.gather(*[self.actors[ps].pull.remote(min_version, union[ps] or None, "shared")
                                         for ps in order])
        self.stats_["pulls_out"] += len(order)
        out = {}
        for ps, (_, values, _) in zip(order, replies):
            out[ps] = {key: (union[ps][key], v) if key in union[ps] else v for key, v in values.items()}
        return out


def _add(arrays: list) -> np.ndarray:
    total = np.array(arrays[0])
    for a in arrays[1:]:
        total += a
    return total
