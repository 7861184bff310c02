"""Ranks of a collective as threads of one process.

``ThreadBackend`` meets the ``CollectiveBackend`` contract (``tests/test_contract_backend.py`` runs
it with the real backends), so the synchronization channels and their compressors run over several
ranks without Ray or sockets: the fast tests use it, and ``benchmarks/accelerator_efficiency.py``
simulates a data-parallel job's all-reduce in one process on a machine without Ray. ``run_ranks``
runs one function per rank in its own thread and returns the results in rank order.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from autosync.runtime.sync.base import CollectiveBackend

TIMEOUT_S = 10.0   # a rank that waits longer for its peers fails (a test never hangs)


class ThreadGroup:
    """What the ranks of one group share: the buffers posted under each tag until all ranks read."""

    def __init__(self, world: int):
        self.world = world
        self.cond = threading.Condition()
        self.posts: dict[str, dict[int, np.ndarray]] = {}
        self.reads: dict[str, int] = {}

    def exchange(self, tag: str, rank: int, arr: np.ndarray) -> list[np.ndarray]:
        with self.cond:
            posts = self.posts.setdefault(tag, {})
            if rank in posts:
                raise RuntimeError(f"rank {rank} posted tag {tag!r} twice")
            posts[rank] = np.array(arr, copy=True)
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: len(posts) == self.world, timeout=TIMEOUT_S):
                raise TimeoutError(f"tag {tag!r}: ranks {sorted(posts)} of {self.world} arrived")
            out = [posts[r] for r in range(self.world)]
            self.reads[tag] = self.reads.get(tag, 0) + 1
            if self.reads[tag] == self.world:
                del self.posts[tag], self.reads[tag]
            return out


class ThreadBackend(CollectiveBackend):
    """One thread's end of a ``ThreadGroup``; counts the bytes it hands to collectives."""

    name = "thread"

    def __init__(self, rank: int, world: int, group: ThreadGroup):
        self.rank, self.world, self.group = rank, world, group
        self.bytes_reduced = 0

    @classmethod
    def prepare(cls, world, group, actor_options=None):
        return ThreadGroup(world)

    @classmethod
    def connect(cls, rank, world, setup):
        if setup.world != world:
            raise ValueError(f"group of {setup.world} ranks, joined with world {world}")
        return cls(rank, world, setup)

    def allreduce(self, buf, tag):
        buf = np.asarray(buf)
        self.bytes_reduced += buf.nbytes
        parts = self.group.exchange(f"reduce/{tag}", self.rank, buf)
        total = parts[0].copy()
        for p in parts[1:]:   # rank order: every rank adds in the same order, so all get the same bits
            total += p
        return total

    def allgather(self, arr, tag):
        return self.group.exchange(f"gather/{tag}", self.rank, np.asarray(arr))


def run_ranks(world: int, fn) -> list:
    """``fn(rank)`` for every rank, each in its own thread; results in rank order (a rank's
    exception is raised here)."""
    with ThreadPoolExecutor(max_workers=world) as pool:
        futures = [pool.submit(fn, r) for r in range(world)]
        return [f.result(timeout=3 * TIMEOUT_S) for f in futures]
