"""Measure a cluster's communication costs (``autosync calibrate``): the collective backend's
all-reduce time per message size over every worker slot, and a parameter server's push + pull
round trip per size (over the PS data plane, ``psnet``), stored as the ClusterSpec's
``calibration`` section.

One Ray actor per worker slot, pinned to its node as training workers are; all-reduces of
float32 buffers from ``SIZES`` (4 KiB to 64 MiB), each timed on rank 0 after a barrier (a tiny
all-reduce that lines the ranks up), median of ``reps``. The PS round trip: an actor on the last
node echoes a buffer sent by a client on the chief (push the bytes, pull them back), as a
parameter server's one batched call per step moves them.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace

import numpy as np

from strategy_space import ClusterSpec
from strategy_space.calibration import Calibration, settled
from strategy_space.errors import ConfigError

SIZES = tuple(4 ** k * 1024 for k in range(1, 9))   # 4 KiB ... 64 MiB
MIN_REPS = 3


class _CollectiveProbe:
    """One worker slot's end of the measured collective group."""

    def __init__(self, threads: int = 1):
        try:
            import torch

            torch.set_num_threads(threads)
        except ImportError:   # the object-store backend needs no torch
            pass
        self.backend = None

    def connect(self, backend: str, rank: int, world: int, setup) -> None:
        from autosync.runtime.sync.backends import BACKENDS

        self.backend = BACKENDS[backend].connect(rank, world, setup)

    def allreduce_times(self, nbytes: int, reps: int, tag: str) -> list[float]:
        buf = np.ones(nbytes // 4, dtype=np.float32)
        buf = self.backend.allreduce(buf, f"{tag}/warm")
        tick = np.zeros(1, dtype=np.float32)
        times = []
        for i in range(reps):
            self.backend.allreduce(tick.copy(), f"{tag}/{i}/barrier")
            t = time.perf_counter()
            buf = self.backend.allreduce(buf, f"{tag}/{i}")
            times.append(time.perf_counter() - t)
        return times

    def round_trips(self, server, endpoint: str | None, nbytes: int, reps: int) -> list[float]:
        """Push and pull of ``nbytes`` as the PS path moves them: over the data plane's link to
        ``endpoint`` (``psnet``), or as a Ray call when there is none (``AUTOSYNC_PS_TRANSPORT=ray``)."""
        import ray

        from autosync.runtime.psnet import Link

        buf = np.ones(nbytes // 4, dtype=np.float32)
        link = Link(endpoint, server) if endpoint else None
        echo = (lambda: link.call("echo", buf).result()) if link else (lambda: ray.get(server.echo.remote(buf)))
        try:
            echo()   # warm-up
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                echo()
                times.append(time.perf_counter() - t)
            return times
        finally:
            if link is not None:
                link.close()

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()


class _EchoServer:
    """A parameter server's answer reduced to its bytes: the pushed buffer comes back, through
    the PS data plane (``listen``) or a Ray call (``echo``), as the PS path runs."""

    def __init__(self):
        self._server = None

    async def echo(self, buf: np.ndarray) -> np.ndarray:
        return buf

    async def ready(self) -> bool:
        return True

    async def listen(self) -> str:
        from autosync.runtime.psnet import Server, node_address

        async def answer(method, args):
            return args[0]

        self._server = Server(answer, node_address())
        return self._server.endpoint


def calibrate(cluster: ClusterSpec, *, sizes=SIZES, reps: int = 5, backend: str = "auto",
              timeout_s: float = 600.0) -> ClusterSpec:
    """``cluster`` with its measured ``calibration`` (binds to the running Ray cluster, or starts
    the embedded one for ``local``).

    Args:
        cluster: the cluster to measure.
        sizes: message sizes in bytes (multiples of 4, increasing).
        reps: timed repetitions per size (median).
        backend: collective backend (``auto``: as training resolves it).
        timeout_s: bound on each measurement call.

    Raises:
        ConfigError: bad arguments, a cluster Ray cannot place, or fewer than two worker slots
            (a collective needs two).
    """
    sizes = tuple(int(s) for s in sizes)
    if reps < MIN_REPS or not sizes or any(s < 4 or s % 4 for s in sizes) or list(sizes) != sorted(set(sizes)):
        raise ConfigError(f"calibrate needs reps >= {MIN_REPS} (got {reps}) and increasing sizes that are "
                          f"multiples of 4 bytes (got {list(sizes)})")
    devices = cluster.devices
    if len(devices) < 2:
        raise ConfigError(f"cluster {cluster.name} has {len(devices)} worker slot(s); a collective needs at least "
                          f"two: give a node workers: 2 or more, or add a node")
    import ray

    from autosync.runtime import psnet
    from autosync.runtime.sync.backends import resolve_backend
    from autosync.runtime.binding import ClusterBinding

    binding = ClusterBinding.bind(cluster)
    probes = []
    try:
        gpus = all(n.gpus > 0 for n in cluster.nodes if n.workers)
        cls = resolve_backend(backend, gpus)
        chief = cluster.chief.name
        actor = ray.remote(_CollectiveProbe)
        for d in devices:   # each on its worker slot's GPU, where it has one (as the workers)
            node = d.split(":")[0]
            probes.append(actor.options(**binding.actor_options(node, num_gpus=binding.slot_gpus(d))).remote())
        group = f"calibrate-{cls.name}-{time.time_ns()}"
        setup = cls.prepare(len(probes), group, binding.actor_options(chief))
        ray.get([p.connect.remote(cls.name, r, len(probes), setup) for r, p in enumerate(probes)], timeout=timeout_s)
        allreduce = []
        for n in sizes:
            per_rank = ray.get([p.allreduce_times.remote(n, reps, f"{n}") for p in probes], timeout=timeout_s)
            allreduce.append((n, statistics.median(per_rank[0])))
        server_node = cluster.nodes[-1].name
        server = ray.remote(_EchoServer).options(**binding.actor_options(server_node)).remote()
        endpoint = ray.get(server.listen.remote(), timeout=timeout_s) if psnet.transport() == "zmq" else None
        client = probes[0]
        ps = [(n, statistics.median(ray.get(client.round_trips.remote(server, endpoint, n, reps), timeout=timeout_s)))
              for n in sizes]
        ray.kill(server)
        ray.get([p.close.remote() for p in probes], timeout=timeout_s)
    finally:
        for p in probes:
            ray.kill(p)
        binding.close()
    return replace(cluster, calibration=Calibration(cls.name, len(devices), tuple(allreduce), tuple(ps)))


def bus_bandwidth_gbps(calibration: Calibration) -> float:
    """Bus bandwidth of the largest measured all-reduce: 2(n-1)/n x bytes / seconds, Gbit/s."""
    n, (nbytes, seconds) = calibration.workers, calibration.allreduce[-1]
    return 2 * (n - 1) / n * nbytes * 8 / seconds / 1e9


def _smallest(points, what: str) -> str:
    """The smallest size's time as the cost model reads it (``settled``), and what was measured
    there where that was slower (a disturbed measurement, which the model does not use)."""
    used, (nbytes, measured) = settled(points)[0], points[0]
    text = f"{what} {used * 1e3:.2f} ms at {nbytes >> 10} KiB"
    if measured > used * 1.05:
        text += f" (measured {measured * 1e3:.2f} ms there, slower than at a larger size: that size's time is used)"
    return text


def summary(name: str, calibration: Calibration) -> str:
    """The line ``autosync calibrate`` prints: bus bandwidth at the largest all-reduce, and the
    smallest all-reduce and PS round trip as the cost model uses them."""
    cal = calibration
    return (f"calibrated {name}: {cal.backend} all-reduce over {cal.workers} workers, "
            f"{bus_bandwidth_gbps(cal):.2f} Gbit/s bus bandwidth at {cal.allreduce[-1][0] >> 20} MiB, "
            f"{_smallest(cal.allreduce, 'all-reduce')}; {_smallest(cal.ps_round_trip, 'PS round trip')}")
