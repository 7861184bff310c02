"""Collective backends for all-reduce, behind one registry.

A backend is set up in two steps: the driver calls ``prepare(world)`` once per worker pool (it may
create helper actors) and passes the result to every worker, which calls ``connect(rank, world,
setup)`` inside its actor process. A connected backend offers ``allreduce`` (sum of a 1-D buffer)
and ``allgather`` (arrays of any length, e.g. sparse indices).

* ``gloo``: ``ray.util.collective`` over torch.distributed's gloo. Ray creates the process-wide
  torch world on first use, so one gloo world lives as long as the worker processes do; the
  runtime prepares it once per worker pool.
* ``nccl``: the same API on GPUs (needs CUDA GPUs and cupy; a clear error otherwise).
* ``objectstore``: reduce-scatter then all-gather through Ray's object store: every worker puts
  the chunk each peer reduces and trades ObjectRefs through a small async ``Mailbox`` actor, so a
  buffer crosses each link about 2(n-1)/n times, as in a ring — and needs nothing beyond Ray.
* ``graph``: TensorFlow's own collective ops (ring over gRPC on CPUs, NCCL on GPUs), run inside
  the worker's training step (``autosync.runtime.sync.graph``; transport in
  ``autosync.runtime.sync.tf_collective``).
* ``auto``: on GPUs graph (NCCL inside the training step; nccl if TensorFlow is missing); on CPUs
  gloo if torch is importable, else objectstore. TensorFlow's gRPC ring measured 0.07-0.32x the
  bus bandwidth of plain gloo on one machine (benchmarks/allreduce_bandwidth.py), so on CPUs
  graph is a strategy choice, not the default.
"""
from __future__ import annotations

import asyncio
import fcntl
import importlib.util
import os
import socket
import struct

import numpy as np

from autosync.runtime.sync.base import CollectiveBackend
from autosync.runtime.sync.tf_collective import GraphBackend
from strategy_space.errors import ConfigError
from strategy_space.strategy import BACKENDS as STRATEGY_BACKENDS

GLOO_TIMEOUT_MS = 120_000


def interface_for_address(ip: str) -> str | None:
    """The network interface that holds ``ip`` on this machine (None if none does)."""
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


class GlooBackend(CollectiveBackend):
    name = "gloo"

    def __init__(self, rank: int, world: int, group: str):
        self.rank, self.world, self.group = rank, world, group

    @classmethod
    def connect(cls, rank, world, setup):
        import ray
        import ray.util.collective as col

        # inside a network namespace the host name resolves to an address that is not there:
        # pin gloo to the interface that holds this node's Ray address
        ifname = interface_for_address(ray.util.get_node_ip_address())
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        if not col.is_group_initialized(setup):
            col.init_collective_group(world, rank, backend="gloo", group_name=setup, gloo_timeout=GLOO_TIMEOUT_MS)
        return cls(rank, world, setup)

    def allreduce(self, buf, tag):
        import ray.util.collective as col

        buf = np.ascontiguousarray(buf)
        if not buf.flags.writeable:
            buf = buf.copy()
        col.allreduce(buf, group_name=self.group)
        return buf

    def allgather(self, arr, tag):
        import ray.util.collective as col

        arr = np.ascontiguousarray(arr)
        # lengths first: gloo gathers equal shapes only, so pad to the longest
        n = np.array([arr.shape[0]], dtype=np.int64)
        lengths = [np.zeros(1, dtype=np.int64) for _ in range(self.world)]
        col.allgather(lengths, n, group_name=self.group)
        longest = int(max(x[0] for x in lengths))
        padded = np.zeros((longest,) + arr.shape[1:], dtype=arr.dtype)
        padded[: arr.shape[0]] = arr
        out = [np.empty_like(padded) for _ in range(self.world)]
        col.allgather(out, padded, group_name=self.group)
        return [o[: int(k[0])] for o, k in zip(out, lengths)]

    def close(self):
        import ray.util.collective as col

        if col.is_group_initialized(self.group):
            col.destroy_collective_group(self.group)


class NcclBackend(GlooBackend):
    name = "nccl"

    @classmethod
    def connect(cls, rank, world, setup):
        import ray.util.collective as col

        if not col.nccl_available():
            raise ConfigError("all_reduce backend nccl needs CUDA GPUs with NCCL (and cupy) on every worker; "
                              "none is available here: use backend gloo, objectstore or auto")
        if not col.is_group_initialized(setup):
            col.init_collective_group(world, rank, backend="nccl", group_name=setup)
        return cls(rank, world, setup)


class Mailbox:
    """Async actor (wrapped with ray.remote by ``ObjectStoreBackend.prepare``) where workers trade
    ObjectRefs: each ``exchange`` posts what a rank sends to every peer and returns, once all
    ranks posted under the same tag, what every peer sent to it."""

    def __init__(self, world: int):
        self.world = world
        self.posts: dict[str, dict[int, list]] = {}
        self.events: dict[str, asyncio.Event] = {}
        self.reads: dict[str, int] = {}

    async def exchange(self, tag: str, rank: int, outgoing: list) -> list:
        posts = self.posts.setdefault(tag, {})
        event = self.events.setdefault(tag, asyncio.Event())
        posts[rank] = outgoing
        if len(posts) == self.world:
            event.set()
        await event.wait()
        incoming = [posts[src][rank] for src in range(self.world)]
        self.reads[tag] = self.reads.get(tag, 0) + 1
        if self.reads[tag] == self.world:  # everyone has its refs: forget the tag
            del self.posts[tag], self.events[tag], self.reads[tag]
        return incoming


class ObjectStoreBackend(CollectiveBackend):
    name = "objectstore"

    def __init__(self, rank: int, world: int, mailbox):
        self.rank, self.world, self.mailbox = rank, world, mailbox
        self.calls = 0

    @classmethod
    def prepare(cls, world, group, actor_options=None):
        import ray

        # takes no CPU from the workers; placed where the caller says (the chief node)
        options = {**(actor_options or {}), "num_cpus": 0, "max_concurrency": max(8, 4 * world)}
        return ray.remote(Mailbox).options(**options).remote(world)

    @classmethod
    def connect(cls, rank, world, setup):
        return cls(rank, world, setup)

    def _trade(self, tag: str, outgoing: list) -> list:
        import ray

        self.calls += 1
        refs = ray.get(self.mailbox.exchange.remote(tag, self.rank, outgoing))
        mine = [i for i, r in enumerate(refs) if r is None]
        values = ray.get([r for r in refs if r is not None])
        # a rank's own part never travels: None marks it
        out: list = []
        it = iter(values)
        for i in range(len(refs)):
            out.append(None if i in mine else next(it))
        return out

    def allreduce(self, buf, tag):
        import ray

        if self.world == 1:
            return buf
        chunks = np.array_split(buf, self.world)
        # reduce-scatter: rank j sums everyone's chunk j
        outgoing = [None if j == self.rank else ray.put(chunks[j]) for j in range(self.world)]
        incoming = self._trade(f"{tag}/rs", outgoing)
        piece = chunks[self.rank].copy()
        for j, part in enumerate(incoming):
            if j != self.rank:
                piece += part
        # all-gather of the reduced pieces
        ref = ray.put(piece)
        pieces = self._trade(f"{tag}/ag", [None if j == self.rank else ref for j in range(self.world)])
        pieces[self.rank] = piece
        return np.concatenate(pieces)

    def allgather(self, arr, tag):
        import ray

        if self.world == 1:
            return [arr]
        ref = ray.put(np.ascontiguousarray(arr))
        parts = self._trade(f"{tag}/gather", [None if j == self.rank else ref for j in range(self.world)])
        parts[self.rank] = arr
        return parts


class HierarchicalBackend(CollectiveBackend):
    """Reduce on the node, all-reduce among one leader per node, broadcast on the node.

    Only the leaders' traffic crosses the NICs: a node's workers hand their buffers to the leader
    through the node's own object store (a node ``Mailbox``), the leaders all-reduce (or gather)
    among themselves through the object store (``ObjectStoreBackend`` over a leaders' mailbox: a
    gloo world cannot be split into node and leader groups, torch allows one per process), and
    each leader hands the result back on its node. Set up by the runtime (``prepare_hierarchy``),
    not by name.

    Args:
        rank: global rank.
        node_rank, node_size: position among the node's workers and their number (rank 0 leads).
        node_mailbox: the node's Mailbox (None for a node with one worker).
        leaders: ObjectStoreBackend of the leaders (None for a non-leader).
    """

    name = "hierarchical"

    def __init__(self, rank: int, node_rank: int, node_size: int, node_mailbox, leaders):
        self.rank, self.node_rank, self.node_size = rank, node_rank, node_size
        self.node = ObjectStoreBackend(node_rank, node_size, node_mailbox) if node_size > 1 else None
        self.leaders = leaders

    @classmethod
    def connect(cls, rank, world, setup):
        node_rank, node_size, node_mailbox, leader_rank, leader_world, leader_mailbox = setup["ranks"][rank]
        leaders = ObjectStoreBackend(leader_rank, leader_world, leader_mailbox) if node_rank == 0 else None
        return cls(rank, node_rank, node_size, node_mailbox, leaders)

    def _to_leader(self, arr, tag: str) -> list | None:
        """The node's arrays at the leader (node rank order), None elsewhere."""
        import ray

        if self.node is None:
            return [arr]
        ref = None if self.node_rank == 0 else ray.put(np.ascontiguousarray(arr))
        got = self.node._trade(f"{tag}/up", [ref if j == 0 else None for j in range(self.node_size)])
        if self.node_rank != 0:
            return None
        got[0] = arr
        return got

    def _from_leader(self, value, tag: str):
        import ray

        if self.node is None:
            return value
        ref = ray.put(value) if self.node_rank == 0 else None
        got = self.node._trade(f"{tag}/down", [ref if self.node_rank == 0 and j else None
                                               for j in range(self.node_size)])
        return value if self.node_rank == 0 else got[0]

    def allreduce(self, buf, tag):
        parts = self._to_leader(buf, tag)
        total = None
        if parts is not None:
            local = parts[0].copy()
            for p in parts[1:]:
                local += p
            total = self.leaders.allreduce(local, f"{tag}/leaders")
        return self._from_leader(total, tag)

    def allgather(self, arr, tag):
        parts = self._to_leader(arr, tag)
        everyone = None
        if parts is not None:
            # leaders trade their node's arrays, each prefixed by the per-worker lengths
            counts = np.array([len(p) for p in parts], dtype=np.int64)
            width = int(np.prod(arr.shape[1:]))
            block = np.concatenate([np.asarray(p).reshape(len(p), width) for p in parts])
            nodes = self.leaders.allgather(block, f"{tag}/leaders/values")
            all_counts = self.leaders.allgather(counts, f"{tag}/leaders/counts")
            everyone = []
            for block, cs in zip(nodes, all_counts):
                offset = 0
                for c in cs:
                    everyone.append(block[offset:offset + int(c)].reshape((int(c),) + arr.shape[1:]))
                    offset += int(c)
        return self._from_leader(everyone, tag)


def prepare_hierarchy(replica_nodes: list[str], actor_options) -> dict:
    """Driver side: mailboxes for a hierarchical collective over workers on ``replica_nodes``
    (node name per global rank, in rank order); ``actor_options(node)`` places a node's mailbox.

    Returns:
        ``{"ranks": {rank: (node_rank, node_size, node_mailbox, leader_rank, leaders, leader_mailbox)}}``
        with ``"mailboxes"``: every helper actor made (to kill with the session).
    """
    import ray

    nodes: dict[str, list[int]] = {}
    for rank, node in enumerate(replica_nodes):
        nodes.setdefault(node, []).append(rank)
    order = list(nodes)
    leader_box = ObjectStoreBackend.prepare(len(order), "", actor_options(order[0])) if len(order) > 1 else None
    boxes = [leader_box] if leader_box is not None else []
    ranks = {}
    for leader_rank, node in enumerate(order):
        members = nodes[node]
        box = None
        if len(members) > 1:
            box = ray.remote(Mailbox).options(**{**actor_options(node), "num_cpus": 0,
                                                 "max_concurrency": max(8, 4 * len(members))}).remote(len(members))
            boxes.append(box)
        for node_rank, rank in enumerate(members):
            ranks[rank] = (node_rank, len(members), box, leader_rank, len(order), leader_box)
    return {"ranks": ranks, "mailboxes": boxes}


# the implementation of every backend a strategy may name (``strategy_space.strategy.BACKENDS``, the
# registry of names) but ``auto``, which ``resolve_backend`` resolves to one of them
BACKENDS: dict[str, type[CollectiveBackend]] = {
    cls.name: cls for cls in (GlooBackend, NcclBackend, ObjectStoreBackend, GraphBackend)}


def gloo_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def graph_available() -> bool:
    return importlib.util.find_spec("tensorflow") is not None


def resolve_backend(name: str, gpus: bool) -> type[CollectiveBackend]:
    """The backend class for a strategy's ``backend`` field.

    Raises:
        ConfigError: unknown name, or gloo requested without torch installed.
    """
    if name == "auto":
        if gpus:
            name = "graph" if graph_available() else "nccl"
        else:
            name = "gloo" if gloo_available() else "objectstore"
    if name not in BACKENDS:
        raise ConfigError(f"unknown all-reduce backend {name!r}; valid: {', '.join(STRATEGY_BACKENDS)}")
    if name == "graph" and not graph_available():
        raise ConfigError("all_reduce backend graph needs TensorFlow on the driver and the workers; "
                          "install it or use backend gloo or objectstore")
    if name == "gloo" and not gloo_available():
        raise ConfigError("all_reduce backend gloo needs torch (CPU build): pip install torch==2.13.0 "
                          "(pinned: an unpinned torch pulls GBs of CUDA packages), or use backend objectstore")
    return BACKENDS[name]
