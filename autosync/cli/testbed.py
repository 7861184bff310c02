"""``autosync testbed up|shape|status|down|exec``: the emulated multi-node Ray cluster.

Heavy imports (Ray) happen only inside the commands that need them.
"""
from __future__ import annotations

import argparse
import json
import sys

from strategy_space.errors import ConfigError

DEFAULTS = {"nodes": 3, "bandwidth": "1gbit", "cpus_per_node": 1, "object_store_mb": 1000}


def register(subparsers) -> None:
    """Add ``testbed`` and its sub-commands."""
    p = subparsers.add_parser(
        "testbed", help="an emulated multi-node Ray cluster on this machine (needs root)",
        description="Network namespaces host0..hostN-1 on a bridge, a tc rate limit on each host's link in "
                    "each direction, and one Ray node per namespace. State folder: $AUTOSYNC_TESTBED_DIR "
                    "or /tmp/autosync-testbed; `--cluster testbed` reads its ClusterSpec.")
    sub = p.add_subparsers(dest="testbed_command", metavar="ACTION", required=True)

    up = sub.add_parser("up", help="create the namespaces, shape the links, start Ray, write the ClusterSpec")
    up.add_argument("--nodes", type=int, help=f"number of hosts (default {DEFAULTS['nodes']}; with --like: "
                                               f"as many of the target's as fit)")
    up.add_argument("--bandwidth", help=f"per-host rate each direction: 1gbit, 200mbit, ... or none "
                                        f"(default {DEFAULTS['bandwidth']}); a comma-separated list gives each "
                                        f"host its own (host0 first; --nodes defaults to its length)")
    up.add_argument("--like", metavar="CLUSTER.yaml",
                    help="shape the testbed like this cluster: its nodes (as many as fit), each with its workers "
                         "and its link at its bandwidth / --dilation")
    up.add_argument("--dilation", type=float, metavar="K",
                    help="with --like: links run K times slower than the target's and the ClusterSpec records "
                         "compute_dilation K (emulated compute K times slower), keeping the target's "
                         "communication-to-compute ratio")
    up.add_argument("--cpus-per-node", type=int, default=DEFAULTS["cpus_per_node"],
                    help="logical CPUs each Ray node advertises (default %(default)s)")
    up.add_argument("--object-store-mb", type=int, default=DEFAULTS["object_store_mb"],
                    help="object store of each Ray node in MiB (default %(default)s)")
    up.set_defaults(func=_up)

    shape = sub.add_parser("shape", help="change the link rate of every host at run time")
    shape.add_argument("--bandwidth", required=True, help="1gbit, 200mbit, ... or none")
    shape.set_defaults(func=_shape)

    status = sub.add_parser("status", help="namespaces, link rates, Ray nodes alive, memory of the processes")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.set_defaults(func=_status)

    down = sub.add_parser("down", help="stop the processes in the testbed's namespaces and delete them")
    down.set_defaults(func=_down)

    ex = sub.add_parser("exec", help="run a command inside host0 with RAY_ADDRESS etc. set",
                        usage="autosync testbed exec -- CMD [ARG...]")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    ex.set_defaults(func=_exec)


def _failed(action: str, err: Exception) -> int:
    print(f"autosync testbed {action}: failed: {err}", file=sys.stderr)
    return 1


def up_config(args, mem_available_mb: float, cores: int):
    """The TestbedConfig ``up`` brings up, and the warnings to print first.

    Raises:
        ConfigError: a bad combination of flags (``--dilation`` without ``--like``, ``--like`` with
            ``--bandwidth``) or a bad target.
    """
    from autosync.sources import load_cluster
    from autosync.testbed.config import TestbedConfig
    from autosync.testbed.like import like_config, oversubscription_warning

    if args.like is None:
        if args.dilation is not None:
            raise ConfigError("--dilation scales the links of a target cluster: give it with --like CLUSTER.yaml "
                              "(without --like, set the rate directly with --bandwidth)")
        # (``--nodes 0`` or ``--bandwidth ""`` is refused by TestbedConfig, not read as "not given")
        bandwidth = DEFAULTS["bandwidth"] if args.bandwidth is None else args.bandwidth
        each = tuple(b.strip() for b in bandwidth.split(",")) if "," in bandwidth else ()
        nodes = (len(each) or DEFAULTS["nodes"]) if args.nodes is None else args.nodes
        if each and len(each) != nodes:
            raise ConfigError(f"--bandwidth {bandwidth} gives {len(each)} rates for --nodes {nodes}: give one per "
                              f"host (host0 first), or one rate for all")
        config = TestbedConfig(nodes=nodes, bandwidth=bandwidth, cpus_per_node=args.cpus_per_node,
                               object_store_mb=args.object_store_mb)
        notes: list[str] = []
    else:
        if args.bandwidth is not None:
            raise ConfigError(f"--like takes the bandwidth from {args.like} (divided by --dilation); leave out "
                              f"--bandwidth {args.bandwidth}, or drop --like")
        plan = like_config(load_cluster(args.like), 1.0 if args.dilation is None else args.dilation,
                           nodes=args.nodes, cpus_per_node=args.cpus_per_node, object_store_mb=args.object_store_mb,
                           mem_available_mb=mem_available_mb)
        config, notes = plan.config, list(plan.notes)
    warning = oversubscription_warning(config, cores)
    return config, notes + ([warning] if warning else [])


def _mem_available_mb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("inf")


def _up(args) -> int:
    import os

    from autosync.testbed import Testbed, TestbedError

    config, notes = up_config(args, _mem_available_mb(), os.cpu_count() or 1)
    for note in notes:
        print(f"autosync testbed up: warning: {note}", file=sys.stderr)
    tb = Testbed(config=config)
    try:
        tb.up(progress=lambda line: print(line + " ...", flush=True))
    except TestbedError as e:
        return _failed("up", f"{e}\n(everything it had made has been removed)")
    st = tb.state
    each = (f"{st.config.workers_per_node} workers per node" if not st.config.node_workers else
            f"workers per node {', '.join(map(str, st.config.node_workers))}")
    like = (f" like {st.config.like} ({each}, compute dilation {st.config.compute_dilation:g})"
            if st.config.like else "")
    print(f"testbed up in {st.up_seconds:.1f} s: {', '.join(st.namespaces)} at {st.config.links}{like}; "
          f"Ray head {st.ray_address}")
    print(f"state: {tb.state_dir}; use `--cluster testbed`, or `autosync testbed exec -- CMD` to run a driver")
    return 0


def _shape(args) -> int:
    from autosync.testbed import TestbedError, shape

    try:
        st = shape(args.bandwidth)
    except TestbedError as e:
        return _failed("shape", e)
    print(f"every host's link now runs at {st.config.bandwidth} each way")
    return 0


def _status(args) -> int:
    from autosync.testbed import status

    info = status()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    st = info["state"]
    if st is None:
        print(f"no testbed recorded in {info['state_dir']}")
        return 0
    cfg = st["config"]
    print(f"testbed: {cfg['nodes']} nodes, {cfg['bandwidth']}, {cfg['cpus_per_node']} CPU(s) and "
          f"{cfg['object_store_mb']} MiB object store per node; phase {st['phase']}; state in {info['state_dir']}")
    for ns, present in info["namespaces"].items():
        line = f"  {ns:<12} {'present' if present else 'MISSING'}"
        if ns in info["links"]:
            link = info["links"][ns]
            mem = info["memory"].get(ns, {})
            line += (f"  upload {link['upload']}, download {link['download']}; "
                     f"{mem.get('processes', 0)} processes, {mem.get('rss_mib', 0):.0f} MiB")
        print(line)
    ray = info.get("ray")
    if ray is None:
        print("  ray: not probed (testbed not fully up)")
    elif "error" in ray:
        print(f"  ray: {ray['error']}")
    else:
        for node in ray["alive"]:
            labels = sorted(k for k in node["resources"] if k.startswith("host"))
            print(f"  ray node {node['address']} alive, CPU {node['resources'].get('CPU', 0):g}, "
                  f"resources {', '.join(labels)}")
        print(f"  ray: {len(ray['alive'])} alive, {ray['dead']} dead")
    total = sum(m["rss_mib"] for m in info["memory"].values())
    print(f"  memory of the testbed's processes: {total:.0f} MiB")
    return 0


def _down(args) -> int:
    from autosync.testbed import down

    report = down()
    if not report.namespaces:
        print("nothing to tear down")
        return 0
    p = report.processes
    print(f"testbed down in {report.seconds:.1f} s: removed {', '.join(report.namespaces)}; "
          f"{p['terminated']} processes got SIGTERM, {p['killed']} SIGKILL"
          + (f", {p['left']} would not die" if p["left"] else ""))
    return 1 if p["left"] else 0


def _exec(args) -> int:
    from autosync.testbed import exec_in_head

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ConfigError("give the command to run inside host0 after --, e.g. "
                          "`autosync testbed exec -- python train.py`")
    return exec_in_head(cmd).returncode
