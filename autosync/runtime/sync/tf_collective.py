"""TensorFlow's own collective ops across Ray worker actors (the ``graph`` backend's transport).

Each worker process becomes one task of a TensorFlow cluster (``job: worker``, one task per
replica, gRPC between them): it picks a free port on its node's address, the driver gathers every
worker's ``host:port`` and hands the list back, and each worker enables collective ops with that
cluster and task 0 as the group leader. From then on ``CollectiveReduceV2`` / ``CollectiveGatherV2``
work between the workers: a ring over gRPC on CPUs, NCCL where the tensors live on GPUs.

Joining must happen before the process runs any TensorFlow op: tensors and variables created
before it live on ``/job:localhost``, which stops existing when the cluster is set ("unknown
device"). So a worker joins right after it starts and before it builds a model, and it stays in
that cluster for its life (the worker pool kills and restarts workers to form another).

Collective instances are keyed by ``(group key, instance key)`` and TensorFlow caches each
instance's shape, so a key is used for one shape only: in-graph collectives take fixed keys
from a per-session base, and ``GraphBackend``'s eager calls one key per (call site, shape).
"""
from __future__ import annotations

import socket
from typing import Any

import numpy as np

from autosync.runtime.sync.base import CollectiveBackend

GROUP_KEY = 1
# No collective is given a timeout: TensorFlow spends a thread on each timed collective for the
# whole timeout (its POSIX ``Env::SchedClosureAfter`` starts a thread that sleeps it out), so a
# worker running a few collectives a step piled up thousands (ncf under ``all_reduce``: 7,000
# threads after 500 steps, killed by the kernel's refusal of one more before step 1,000). A peer
# that never answers is caught by the driver instead: the call's deadline, Ray's node death, then
# the waiting worker killed (``waiting.wait_all``, ``Trainer``'s salvage).
SESSION_KEYS = 1_000_000  # instance keys each session may use; keys must fit in int32


def free_address() -> str:
    """``host:port`` on this node where a TensorFlow server can listen (the node's Ray address)."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def join(rank: int, addresses: list[str]) -> str:
    """Make this process task ``rank`` of the TensorFlow cluster ``addresses`` with collective
    ops enabled; returns its device name (``/job:worker/replica:0/task:RANK``).

    Raises:
        RuntimeError: TensorFlow already ran ops in this process (join first).
    """
    import tensorflow as tf
    from tensorflow.core.protobuf import tensorflow_server_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    if ctx._context_handle is not None:  # noqa: SLF001 - the only way to tell
        raise RuntimeError("this worker ran TensorFlow before joining the collective group; the "
                           "worker pool must join workers before they load a model")
    server = tensorflow_server_pb2.ServerDef(
        cluster=tf.train.ClusterSpec({"worker": list(addresses)}).as_cluster_def(),
        job_name="worker", task_index=rank, protocol="grpc")
    experimental = server.default_session_config.experimental
    experimental.collective_group_leader = "/job:worker/replica:0/task:0"
    if tf.config.list_physical_devices("GPU"):
        experimental.collective_nccl = True
    ctx.enable_collective_ops(server)
    return f"/job:worker/replica:0/task:{rank}"


def communication_hint() -> str:
    """``nccl`` where this worker computes on a GPU, else ``ring`` (gRPC)."""
    import tensorflow as tf

    return "nccl" if tf.config.list_logical_devices("GPU") else "ring"


def all_reduce(t, world: int, instance_key: int, hint: str):
    """Sum of ``t`` over the group (inside or outside a ``tf.function``)."""
    from tensorflow.python.ops import collective_ops

    return collective_ops.all_reduce_v2(t, group_size=world, group_key=GROUP_KEY, instance_key=instance_key,
                                        merge_op="Add", final_op="Id", communication_hint=hint)


def all_gather(t, world: int, instance_key: int, hint: str):
    """Every worker's ``t`` (equal shapes) concatenated along axis 0, in rank order."""
    from tensorflow.python.ops import collective_ops

    return collective_ops.all_gather_v2(t, group_size=world, group_key=GROUP_KEY, instance_key=instance_key,
                                        communication_hint=hint)


def _padded_length(n: int) -> int:
    """Gathers of varying length are padded to a power of two: few shapes, so few instance keys."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class GraphBackend(CollectiveBackend):
    """TensorFlow collective ops, called from numpy (eagerly) by the all-reduce channel.

    The runtime reduces most ``graph`` members inside the training step instead (see
    ``autosync.runtime.sync.graph``); this class serves the members that cannot be (PowerSGD, a
    variable split between all-reduce and a parameter server) and the bandwidth benchmark.
    ``setup`` is ``{"group": name, "base": first instance key of this session}``; the workers
    joined the group when they started.
    """

    name = "graph"

    def __init__(self, rank: int, world: int, setup: dict):
        self.rank, self.world = rank, world
        self.next_key = int(setup["base"])
        self.keys: dict[tuple, int] = {}
        self.hint = communication_hint()
        self._reduce = self._gather = None

    @classmethod
    def connect(cls, rank: int, world: int, setup: Any) -> "GraphBackend":
        return cls(rank, world, setup)

    def _key(self, site: tuple) -> int:
        key = self.keys.get(site)
        if key is None:
            key = self.keys[site] = self.next_key
            self.next_key += 1
        return key

    @staticmethod
    def _site(tag: str) -> str:
        # tags are "step/group/..."; the call site is the same every step
        return tag.split("/", 1)[1] if "/" in tag else tag

    def _functions(self):
        if self._reduce is None:
            import tensorflow as tf

            world, hint = self.world, self.hint
            self._reduce = tf.function(lambda t, k: all_reduce(t, world, k, hint), autograph=False)
            self._gather = tf.function(lambda t, k: all_gather(t, world, k, hint), autograph=False)
        return self._reduce, self._gather

    def allreduce(self, buf: np.ndarray, tag: str) -> np.ndarray:
        import tensorflow as tf

        reduce, _ = self._functions()
        buf = np.ascontiguousarray(buf)
        key = self._key(("reduce", self._site(tag), buf.shape, buf.dtype.str))
        return reduce(tf.constant(buf), tf.constant(key)).numpy()

    def allgather(self, arr: np.ndarray, tag: str) -> list[np.ndarray]:
        import tensorflow as tf

        _, gather = self._functions()
        arr = np.ascontiguousarray(arr)
        site = self._site(tag)
        counts = gather(tf.constant([arr.shape[0]], tf.int64), tf.constant(self._key(("count", site)))).numpy()
        longest = _padded_length(int(counts.max()))
        padded = np.zeros((longest,) + arr.shape[1:], dtype=arr.dtype)
        padded[: arr.shape[0]] = arr
        key = self._key(("gather", site, padded.shape, arr.dtype.str))
        out = gather(tf.constant(padded), tf.constant(key)).numpy()
        return [out[r * longest: r * longest + int(n)] for r, n in enumerate(counts)]
