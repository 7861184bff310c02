"""How fast Ray moves a PS-sized array between two testbed nodes, against the link rate.

Inside a testbed (``autosync testbed exec``): an actor on host1; from the driver on host0 it
times (median of ``--repeats``) a push (an actor call whose argument is ``--mb`` MB), a pull (a
call that returns that much), both at once (the two directions of the link), and the same bytes
split into ``--chunks`` concurrent calls. The actor runs calls concurrently (``max_concurrency``,
as the PS shards, which are async actors, do); ``push_and_pull_serial_actor``,
``_async_actor`` and ``_two_actors`` repeat the at-once case on an actor that runs one call at a
time, on an async actor and on two actors (push to one, pull from the other): whether the two
directions of the link run at once through Ray's object transfer (the testbed's links are full
duplex: two TCP streams in opposite directions each get the link rate). Prints MB/s against the link rate and writes
``ray_transfer.json`` with the commit and start time.

    sudo flock /tmp/autosync-testbed.lock sh -c 'autosync testbed up --nodes 2 --bandwidth 200mbit &&
        autosync testbed exec -- python benchmarks/ray_transfer.py; autosync testbed down'
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


class Sink:
    def __init__(self, nbytes: int):
        self.data = np.ones(nbytes // 4, np.float32)

    def push(self, array):
        return float(array[0])

    def pull(self, parts: int = 1):
        n = len(self.data) // parts
        return self.data[:n].copy()


class AsyncSink(Sink):
    """The same calls on an async actor, as the PS shards are."""

    async def push(self, array):
        return float(array[0])

    async def pull(self, parts: int = 1):
        n = len(self.data) // parts
        return self.data[:n].copy()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=6.9, help="MB per transfer (default 6.9: one vgg16 PS actor's share)")
    p.add_argument("--chunks", type=int, default=4, help="concurrent calls for the split case (default 4)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    args = p.parse_args(argv)
    if not os.environ.get("RAY_ADDRESS") or args.mb <= 0 or args.chunks < 1 or args.repeats < 1:
        print("ray_transfer runs inside a testbed (`autosync testbed exec`); --mb > 0, --chunks, --repeats >= 1",
              file=sys.stderr)
        return 2
    import ray

    from _testbed import git_commit, write_json
    from autosync.sources import load_cluster

    cluster = load_cluster("testbed")
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
    started, commit = time.strftime("%Y-%m-%d %H:%M:%S"), git_commit(REPO)
    nbytes = int(args.mb * 1e6)
    remote = cluster.nodes[1].name
    sink = ray.remote(Sink).options(resources={remote: 0.01}, num_cpus=0, max_concurrency=4).remote(nbytes)
    serial = ray.remote(Sink).options(resources={remote: 0.01}, num_cpus=0, max_concurrency=1).remote(nbytes)
    asink = ray.remote(AsyncSink).options(resources={remote: 0.01}, num_cpus=0).remote(nbytes)
    ray.get([a.push.remote(np.zeros(4, np.float32)) for a in (sink, serial, asink)])
    data = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    parts = [data[i::args.chunks].copy() for i in range(args.chunks)]

    def timed(fn):
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    cases = {
        "push": lambda: ray.get(sink.push.remote(data)),
        "pull": lambda: ray.get(sink.pull.remote()),
        "push_and_pull_at_once": lambda: ray.get([sink.push.remote(data), sink.pull.remote()]),
        "push_and_pull_serial_actor": lambda: ray.get([serial.push.remote(data), serial.pull.remote()]),
        "push_and_pull_async_actor": lambda: ray.get([asink.push.remote(data), asink.pull.remote()]),
        "push_and_pull_two_actors": lambda: ray.get([serial.push.remote(data), sink.pull.remote()]),
        f"push_in_{args.chunks}_calls": lambda: ray.get([sink.push.remote(x) for x in parts]),
        f"pull_in_{args.chunks}_calls": lambda: ray.get([sink.pull.remote(args.chunks) for _ in range(args.chunks)]),
    }
    link = cluster.nodes[0].bandwidth_gbps * 1e9 / 8 / 1e6
    out = {"meta": {"commit": commit, "started": started, "mb": args.mb, "link_mb_s": link,
                    "repeats": args.repeats}, "entries": {}}
    for name, fn in cases.items():
        t = timed(fn)
        rate = args.mb / t  # each direction carries args.mb in every case
        out["entries"][name] = {"run_started": started, "commit": commit, "median_s": t, "mb_s_per_direction": rate,
                              "of_link": rate / link}
        print(f"{name}: {t * 1e3:.0f} ms, {rate:.1f} MB/s per direction ({rate / link:.0%} of the link)", flush=True)
    ray.shutdown()
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "ray_transfer.json"), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
