"""Effective bus bandwidth of each all-reduce backend vs plain torch.distributed gloo.

For 1, 8 and 64 MiB float32 buffers between 2 and 3 workers on this machine (`local`), times the
all-reduce of AutoSync's backends (inside Ray actors, as the runtime uses them) and of a plain
torch.distributed gloo group of the same size (separate processes, no Ray), in one run, and prints
bus bandwidth = 2(n-1)/n * bytes / time with the ratio to plain gloo. ``graph`` is TensorFlow's
ring all-reduce over gRPC between the actors (the collective the training step runs in-graph),
called here from numpy, so its figure includes the copy into and out of a tensor.

Targets (issue 5): gloo backend >= 0.9x plain gloo; objectstore >= 0.5x plain gloo at 64 MiB.
No target for graph (issue 15 asks for it to be measured next to plain gloo).

    python benchmarks/allreduce_bandwidth.py [--sizes-mib 1 8 64] [--workers 2 3] [--reps 7] [--json out.json]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np

from _rows import commit, write_rows

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _plain_gloo_rank(rank, world, port, sizes, reps, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for n in sizes:
        x = torch.ones(n, dtype=torch.float32)
        dist.all_reduce(x)  # warm-up
        times = []
        for _ in range(reps):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t)
        out[n] = statistics.median(times)
    dist.destroy_process_group()
    if rank == 0:
        queue.put(out)


def plain_gloo(world: int, sizes: list[int], reps: int) -> dict[int, float]:
    """Median all-reduce seconds per size for a plain torch.distributed gloo group."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_plain_gloo_rank, args=(r, world, port, sizes, reps, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return result


class BenchWorker:
    def __init__(self):
        import torch

        torch.set_num_threads(1)

    def address(self):
        from autosync.runtime.sync.tf_collective import free_address

        return free_address()

    def join(self, rank, addresses):
        from autosync.runtime.sync.tf_collective import join

        join(rank, addresses)

    def connect(self, backend, rank, world, setup):
        from autosync.runtime.sync.backends import resolve_backend

        self.b = resolve_backend(backend, gpus=False).connect(rank, world, setup)

    def allreduce(self, n, reps, tag):
        # one buffer reduced again and again, exactly as the plain run does
        buf = np.ones(n, dtype=np.float32)
        # tags are "call/site": unique per call (objectstore), the same site every repetition
        buf = self.b.allreduce(buf, f"warm/{tag}")
        times = []
        tick = np.zeros(1, dtype=np.float32)
        for i in range(reps):
            self.b.allreduce(tick.copy(), f"{i}/{tag}/barrier")  # line the ranks up, as dist.barrier does
            t = time.perf_counter()
            buf = self.b.allreduce(buf, f"{i}/{tag}")
            times.append(time.perf_counter() - t)
        return times


def ray_backend(backend: str, world: int, sizes: list[int], reps: int) -> dict[int, float]:
    import ray

    from autosync.runtime.sync.backends import resolve_backend

    actor = ray.remote(num_cpus=0)(BenchWorker)
    workers = [actor.remote() for _ in range(world)]
    setup = resolve_backend(backend, gpus=False).prepare(world, f"bench-{backend}-{world}-{time.time_ns()}")
    if backend == "graph":  # fresh processes form one TensorFlow cluster before any TF op
        addresses = ray.get([w.address.remote() for w in workers], timeout=120)
        ray.get([w.join.remote(r, addresses) for r, w in enumerate(workers)], timeout=120)
        setup = {"group": setup, "base": 1}
    ray.get([w.connect.remote(backend, r, world, setup) for r, w in enumerate(workers)], timeout=120)
    out = {}
    for n in sizes:
        per_rank = ray.get([w.allreduce.remote(n, reps, f"{n}") for w in workers], timeout=600)
        out[n] = statistics.median(per_rank[0])  # rank 0 after a barrier, like the plain run
    for w in workers:
        ray.kill(w)
    return out


def busbw_gbit(nbytes: int, world: int, seconds: float) -> float:
    return 2 * (world - 1) / world * nbytes * 8 / seconds / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)

    import ray

    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    sizes = [m * 2**20 // 4 for m in args.sizes_mib]
    rows = []
    for world in args.workers:
        base = plain_gloo(world, sizes, args.reps)
        results = {b: ray_backend(b, world, sizes, args.reps) for b in ("gloo", "objectstore", "graph")}
        for n, mib in zip(sizes, args.sizes_mib):
            ref = busbw_gbit(n * 4, world, base[n])
            for name, res in [("plain torch gloo", base)] + list(results.items()):
                bw = busbw_gbit(n * 4, world, res[n])
                rows.append({"workers": world, "MiB": mib, "backend": name, "seconds": res[n],
                             "busbw_gbit": bw, "ratio_to_plain_gloo": bw / ref,
                             "commit": commit(), "started_utc": started})
    ray.shutdown()

    print(f"{'workers':>7} {'MiB':>5} {'backend':<17} {'median s':>9} {'busbw Gbit/s':>13} {'x plain':>8}")
    for r in rows:
        print(f"{r['workers']:>7} {r['MiB']:>5} {r['backend']:<17} {r['seconds']:>9.4f} {r['busbw_gbit']:>13.2f} "
              f"{r['ratio_to_plain_gloo']:>8.2f}")
    big = max(args.sizes_mib)
    for r in rows:
        if r["MiB"] == big and r["backend"] in ("gloo", "objectstore"):
            target = 0.9 if r["backend"] == "gloo" else 0.5
            verdict = "met" if r["ratio_to_plain_gloo"] >= target else "MISSED"
            print(f"target {r['backend']} >= {target}x plain gloo at {big} MiB, {r['workers']} workers: "
                  f"{r['ratio_to_plain_gloo']:.2f}x ({verdict})")
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
