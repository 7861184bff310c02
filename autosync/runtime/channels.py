"""Worker-side synchronization channels.

A worker's step is always: ``values = channel.pull(step)`` (assign them), compute gradients,
``channel.push(step, grads)``. Each synchronizer kind is a channel:

- ``PSChannel`` (here): pushes each PS actor's gradient shards in ONE call and pulls its shards in
  ONE call per step, whatever the number of variables.
- ``autosync.comm.channel.AllReduceChannel`` implements the same two methods: ``push`` reduces the
  fusion groups (gloo, nccl or the object store) and applies the local optimizer, ``pull`` returns
  the locally updated values.

``pull`` returns values per ``(var_index, shard_index)``; the worker puts each variable together
from the parts of every channel, so one variable's shards may be split between PS and all-reduce.

Gradients are given per model variable: a dense ndarray, ``(indices, values)`` for a sparse
(IndexedSlices) gradient, or None (no gradient: nothing is sent).
"""
from __future__ import annotations

import abc

import numpy as np

from autosync.comm.channel import shard_gradient


class SyncChannel(abc.ABC):
    """The synchronization of some variables, seen from one worker.

    Attributes:
        calls: Ray actor calls issued so far (the overhead the runtime is measured by).
    """

    calls: int = 0

    @abc.abstractmethod
    def pull(self, step: int, fresh: bool = False) -> dict[tuple[int, int], np.ndarray]:
        """Values of this channel's shards to compute ``step`` with: (var, shard) -> array.

        ``fresh`` waits for every update before ``step`` (no staleness allowance)."""

    @abc.abstractmethod
    def push(self, step: int, grads: list) -> None:
        """Hand over this worker's gradients of ``step`` (all variables, model order)."""

    def finish(self) -> None:
        """Wait for outstanding work and surface its errors."""


class PSChannel(SyncChannel):
    """Parameter-server synchronization for one worker.

    Args:
        worker_index: this worker's position among the replicas.
        actors: ``[(actor_handle, PSActorPlan), ...]``.
        shapes: shape of every model variable (index -> shape).
        staleness: how many steps this worker may run ahead of the slowest one.
    """

    def __init__(self, worker_index: int, actors: list, shapes: list, staleness: int):
        self.worker_index = worker_index
        self.actors = actors
        self.shapes = [tuple(s) for s in shapes]
        self.staleness = staleness
        self.calls = 0
        self._pushes: list = []

    def pull(self, step: int, fresh: bool = False) -> dict[tuple[int, int], np.ndarray]:
        import ray

        min_version = step if fresh else step - self.staleness
        refs = [actor.pull.remote(min_version) for actor, _ in self.actors]
        self.calls += len(refs)
        replies = ray.get(refs)
        # earlier pushes are complete once their step's values are out; surface their errors
        self._check_pushes()
        shards: dict = {}
        shared = [r[2] for r in replies if r[2] is not None]
        for _, direct, _ in replies:
            shards.update(direct)
        for part in ray.get(shared) if shared else ():
            shards.update(part)
        return shards

    def push(self, step: int, grads: list) -> None:
        for actor, plan in self.actors:
            payload = {}
            for ref in plan.shards:
                g = grads[ref.var_index]
                if g is not None:
                    payload[ref.key] = self._shard_grad(ref, g)
            self._pushes.append(actor.push.remote(self.worker_index, step, payload))
            self.calls += 1

    def finish(self) -> None:
        import ray

        ray.get(self._pushes)
        self._pushes = []

    def _check_pushes(self) -> None:
        import ray

        if self._pushes:
            done, _ = ray.wait(self._pushes, num_returns=len(self._pushes), timeout=0)
            if done:
                ray.get(done)  # raises the PS's error, if any
                keep = set(done)
                self._pushes = [r for r in self._pushes if r not in keep]

    @staticmethod
    def _shard_grad(ref, g):
        return shard_gradient(g, ref.start, ref.stop, ref.axis, ref.num_shards)  # a view; serialized once
