"""Ways to move parameter-server traffic between two testbed nodes, against the link rate.

Three transports, each a maintained engine, between the driver on host0 and a Ray actor on host1:

- ``ray_call``: today's path before this benchmark chose another: the bytes are an actor call's
  argument (a push) or its return value (a pull), moved by Ray's object store;
- ``gloo_p2p``: ``torch.distributed`` point to point (send/recv) on a two-rank gloo group;
- ``zmq``: a ZeroMQ DEALER (driver) to ROUTER (actor) connection, as ps-lite (BytePS, MXNet's PS)
  moves its keys and values; the actor serves it from a thread, as the PS shards serve theirs.

For each message size (default 64 KiB, 1 MiB, 8 MiB, 64 MiB) and transport it times (median of
``--repeats``): a push (the bytes to host1, a small acknowledgement back), a pull (a small request,
the bytes back) and a push and a pull at once (both directions of the link, as a PS step loads a
node's NIC: one worker's push goes out while another's arrives). ``call_overhead_ms`` is the round
trip of an 8-byte request and its reply. ``--json`` prints the record; ``ps_transport.json`` gets
per transport ``{"one_way_link_fraction", "at_once_link_fraction", "call_overhead_ms"}`` at 8 MiB and
at 64 KiB (one-way: the slower of push and pull; at once: bytes per direction over the time of
both), every size's figures, the commit and start time, and ``"default"``: the transport the
runtime's PS data plane uses (``autosync.runtime.psnet.TRANSPORT``).

    sudo flock /tmp/autosync-testbed.lock python benchmarks/ps_transport.py [--sizes-kib 64 8192] [--json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

JSON_NAME = "ps_transport.json"
SIZES_KIB = (64, 1024, 8192, 65536)
TRANSPORTS = ("ray_call", "gloo_p2p", "zmq")
PUSH, PULL, STOP = 1, 2, 3


class Host:
    """The far end (an actor on host1): answers pushes and pulls on every transport."""

    def __init__(self, max_bytes: int):
        self.data = np.ones(max_bytes, np.uint8)
        self.ip = self._ip()

    @staticmethod
    def _ip() -> str:
        import ray

        return ray.util.get_node_ip_address()

    # ray_call
    def push(self, array):
        return int(array[0])

    def pull(self, nbytes: int):
        return self.data[:nbytes]

    def ping(self):
        return 0

    # zmq: a ROUTER served from a thread
    def start_zmq(self) -> str:
        import zmq

        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        port = sock.bind_to_random_port(f"tcp://{self.ip}")

        def serve():
            while True:
                ident, op, payload = sock.recv_multipart(copy=False)
                code = int.from_bytes(op.bytes, "little")
                if code == STOP:
                    break
                if code == PUSH:
                    sock.send_multipart([ident, b"ok"], copy=False)
                else:
                    n = int.from_bytes(payload.bytes, "little")
                    sock.send_multipart([ident, memoryview(self.data[:n])], copy=False)
            sock.close(0)

        threading.Thread(target=serve, daemon=True).start()
        return f"tcp://{self.ip}:{port}"

    # gloo: rank 1 of a two-rank group, its store served here
    def start_gloo(self) -> tuple[str, int]:
        import torch.distributed as dist

        store = dist.TCPStore(self.ip, 0, 2, True, datetime.timedelta(seconds=60), wait_for_workers=False)
        self._store = store
        threading.Thread(target=self._serve_gloo, args=(store,), daemon=True).start()
        return self.ip, store.port

    def _serve_gloo(self, store) -> None:
        import torch

        group = _gloo_group(store, 1, self.ip)
        header = torch.zeros(2, dtype=torch.int64)
        ack = torch.zeros(1, dtype=torch.uint8)
        sink = torch.empty(len(self.data), dtype=torch.uint8)
        source = torch.from_numpy(self.data)
        pending = []
        while True:
            group.recv([header], 0, 0).wait()
            code, n = int(header[0]), int(header[1])
            if code == STOP:
                break
            if code == PUSH:
                group.recv([sink[:n]], 0, 1).wait()
                pending.append(group.send([ack], 0, 2))
            else:
                pending.append(group.send([source[:n]], 0, 3))
            pending = [w for w in pending if not w.is_completed()]
        for w in pending:
            w.wait()
        group.shutdown()


def _gloo_group(store, rank: int, ip: str):
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=ip)]
    options._timeout = datetime.timedelta(seconds=60)
    return dist.ProcessGroupGloo(store, rank, 2, options)


class RayCall:
    def __init__(self, host):
        self.host = host

    def push(self, data):
        import ray

        ray.get(self.host.push.remote(data))

    def pull(self, n):
        import ray

        ray.get(self.host.pull.remote(n))

    def both(self, data):
        import ray

        ray.get([self.host.push.remote(data), self.host.pull.remote(len(data))])

    def ping(self):
        import ray

        ray.get(self.host.ping.remote())

    def close(self):
        pass


class Zmq:
    def __init__(self, host):
        import ray
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.connect(ray.get(host.start_zmq.remote()))

    def _send(self, code, payload):
        self.sock.send_multipart([code.to_bytes(1, "little"), payload], copy=False)

    def push(self, data):
        self._send(PUSH, memoryview(data))
        self.sock.recv_multipart(copy=False)

    def pull(self, n):
        self._send(PULL, n.to_bytes(8, "little"))
        self.sock.recv_multipart(copy=False)

    def both(self, data):
        # the pull's request first: one connection keeps order, and the reply flows back while
        # the push's bytes flow out
        self._send(PULL, len(data).to_bytes(8, "little"))
        self._send(PUSH, memoryview(data))
        self.sock.recv_multipart(copy=False)
        self.sock.recv_multipart(copy=False)

    def ping(self):
        self._send(PULL, (8).to_bytes(8, "little"))
        self.sock.recv_multipart(copy=False)

    def close(self):
        self._send(STOP, b"")
        self.sock.close(linger=1000)


class Gloo:
    def __init__(self, host, max_bytes: int):
        import ray
        import torch
        import torch.distributed as dist

        ip, port = ray.get(host.start_gloo.remote())
        store = dist.TCPStore(ip, port, 2, False, datetime.timedelta(seconds=60))
        me = socket.gethostbyname(socket.gethostname())
        self.group = _gloo_group(store, 0, ray.util.get_node_ip_address() or me)
        self.torch = torch
        self.ack = torch.zeros(1, dtype=torch.uint8)
        self.sink = torch.empty(max_bytes, dtype=torch.uint8)

    def _header(self, code, n):
        return self.group.send([self.torch.tensor([code, n], dtype=self.torch.int64)], 1, 0)

    def push(self, data):
        works = [self._header(PUSH, len(data)), self.group.send([self.torch.from_numpy(data)], 1, 1)]
        self.group.recv([self.ack], 1, 2).wait()
        for w in works:
            w.wait()

    def pull(self, n):
        w = self._header(PULL, n)
        self.group.recv([self.sink[:n]], 1, 3).wait()
        w.wait()

    def both(self, data):
        n = len(data)
        works = [self._header(PULL, n)]
        pulled = self.group.recv([self.sink[:n]], 1, 3)
        works += [self._header(PUSH, n), self.group.send([self.torch.from_numpy(data)], 1, 1)]
        self.group.recv([self.ack], 1, 2).wait()
        pulled.wait()
        for w in works:
            w.wait()

    def ping(self):
        self.pull(8)

    def close(self):
        self._header(STOP, 0).wait()
        self.group.shutdown()


def _timed(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def measure(transport: str, host, sizes: list[int], repeats: int, link_bytes_s: float, pings: int) -> dict:
    client = {"ray_call": lambda: RayCall(host), "zmq": lambda: Zmq(host),
              "gloo_p2p": lambda: Gloo(host, max(sizes))}[transport]()
    try:
        client.ping()
        ping_s, ping_all = _timed(client.ping, pings)
        out = {"call_overhead_ms": ping_s * 1e3,
               "call_overhead_ms_p10_p90": [float(np.percentile(ping_all, q)) * 1e3 for q in (10, 90)], "sizes": {}}
        for n in sizes:
            data = np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8)
            client.both(data)   # warm the path at this size
            row = {}
            for case, fn in (("push", lambda: client.push(data)), ("pull", lambda: client.pull(n)),
                             ("at_once", lambda: client.both(data))):
                t, times = _timed(fn, repeats)
                row[case] = {"median_s": t, "min_s": min(times), "max_s": max(times),
                             "link_fraction": n / t / link_bytes_s}
            row["one_way_link_fraction"] = min(row["push"]["link_fraction"], row["pull"]["link_fraction"])
            row["at_once_link_fraction"] = row["at_once"]["link_fraction"]
            out["sizes"][str(n // 1024)] = row
            print(f"{transport:9s} {n // 1024:6d} KiB: push {row['push']['link_fraction']:.2f}, pull "
                  f"{row['pull']['link_fraction']:.2f}, at once {row['at_once_link_fraction']:.2f} of the link "
                  f"each way", file=sys.stderr, flush=True)
        print(f"{transport:9s} call overhead {out['call_overhead_ms']:.3f} ms", file=sys.stderr, flush=True)
        return out
    finally:
        client.close()


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inside", action="store_true", help="measure only (inside host0 of an existing testbed)")
    p.add_argument("--sizes-kib", type=int, nargs="+", default=list(SIZES_KIB), help="message sizes in KiB")
    p.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per case (default 5)")
    p.add_argument("--pings", type=int, default=200, help="round trips timed for the call overhead (default 200)")
    p.add_argument("--nodes", type=int, default=2, help="testbed nodes (default 2)")
    p.add_argument("--bandwidth", default="200mbit", help="testbed link rate (default 200mbit)")
    p.add_argument("--json", action="store_true", help="print the record as JSON on stdout")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="directory for ps_transport.json")
    return p.parse_args(argv)


def inside(args) -> int:
    import ray

    from _testbed import git_commit, write_json
    from autosync.runtime.psnet import TRANSPORT
    from autosync.sources import load_cluster

    if not os.environ.get("RAY_ADDRESS"):
        print("ps_transport --inside runs inside the testbed's host0 (`autosync testbed exec`)", file=sys.stderr)
        return 2
    cluster = load_cluster("testbed")
    started, commit = time.strftime("%Y-%m-%d %H:%M:%S"), git_commit(REPO)
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
    sizes = [k * 1024 for k in args.sizes_kib]
    link = cluster.nodes[0].bandwidth_gbps * 1e9 / 8
    host = ray.remote(Host).options(resources={cluster.nodes[1].name: 0.01}, num_cpus=0,
                                    max_concurrency=4).remote(max(sizes))
    record = {"meta": {"commit": commit, "run_started": started, "link_bytes_s": link, "repeats": args.repeats,
                       "nodes": len(cluster.nodes), "bandwidth_gbps": cluster.nodes[0].bandwidth_gbps,
                       "what_else_ran": os.environ.get("AUTOSYNC_BENCH_NOTE", "")},
              "default": TRANSPORT, "transports": {}}
    for name in args.transports:
        full = measure(name, host, sizes, args.repeats, link, args.pings)
        entry = {"commit": commit, "run_started": started, "call_overhead_ms": full["call_overhead_ms"]}
        for kib in ("8192", "64"):
            if kib in full["sizes"]:
                entry[f"{kib}KiB"] = {"one_way_link_fraction": full["sizes"][kib]["one_way_link_fraction"],
                                      "at_once_link_fraction": full["sizes"][kib]["at_once_link_fraction"],
                                      "call_overhead_ms": full["call_overhead_ms"]}
        entry["all"] = full
        record["transports"][name] = entry
    ray.shutdown()
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, JSON_NAME), record)
    if args.json:
        print(json.dumps(record, indent=1))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if args.repeats < 1 or args.pings < 1 or any(k < 1 for k in args.sizes_kib):
        print("ps_transport: --repeats, --pings and every --sizes-kib must be >= 1", file=sys.stderr)
        return 2
    if args.inside:
        return inside(args)
    from _testbed import run_in_testbed

    return run_in_testbed(__file__, argv, nodes=args.nodes, bandwidth=args.bandwidth, name="ps_transport",
                          outer_flags={"--nodes", "--bandwidth", "--out"}, extra=["--out", os.path.abspath(args.out)])


if __name__ == "__main__":
    sys.exit(main())
