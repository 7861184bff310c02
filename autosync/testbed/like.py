"""A testbed shaped like a cluster that cannot be built here (``testbed up --like FILE --dilation K``).

The target's nodes (as many as fit) each become a namespace with that node's workers; each
link runs at its node's bandwidth / K, and the written ClusterSpec records
``compute_dilation: K``, so emulated compute runs K times slower than the profile and the
communication-to-compute ratio of the target is kept. What does not scale with K: the fixed cost
of each call (a Ray call, a collective's start-up: they stay as fast as this machine makes them,
so they weigh K times less than on the target) and any CPU work (serialization, optimizer
updates on parameter servers, reductions), which runs at this machine's speed. Real compute
cannot be slowed, so a dilated testbed is for emulated compute only.

Pure: reads no system state except through its arguments.
"""
from __future__ import annotations

from dataclasses import dataclass

from strategy_space import ClusterSpec
from strategy_space.errors import ConfigError

from .config import MAX_NODES, TestbedConfig, format_rate, parse_rate

# a Ray node's own processes (raylet, GCS on the head, workers' idle share), on top of its object store
NODE_OVERHEAD_MB = 300
# links faster than this run into this machine's copy speed (veth at ~several Gbit/s, noisy)
FAITHFUL_RATE_BPS = 1_000_000_000


@dataclass(frozen=True)
class LikePlan:
    """What ``--like`` will bring up and what it had to leave out.

    Attributes:
        config: the testbed's configuration.
        target: name of the cluster it stands for.
        dropped: names of target nodes left out (they did not fit).
        notes: warnings to print (dropped nodes, links too fast to be faithful).
    """

    config: TestbedConfig
    target: str
    dropped: tuple[str, ...]
    notes: tuple[str, ...]


def nodes_that_fit(object_store_mb: int, mem_available_mb: float) -> int:
    """Nodes whose object stores and Ray processes fit in 80 % of the available memory (1..16)."""
    per_node = object_store_mb + NODE_OVERHEAD_MB
    if mem_available_mb == float("inf"):
        return MAX_NODES
    return max(1, min(MAX_NODES, int(0.8 * mem_available_mb // per_node)))


def like_config(target: ClusterSpec, dilation: float, *, nodes: int | None = None, cpus_per_node: int = 1,
                object_store_mb: int = 1000, mem_available_mb: float = float("inf")) -> LikePlan:
    """The testbed that stands for ``target`` with links ``dilation`` times slower.

    Args:
        target: the cluster to imitate: each node brought up gets its bandwidth / K and its
            workers (0 for a node that holds only parameter servers).
        dilation: K >= 1: link rate = target bandwidth / K, emulated compute K times slower.
        nodes: bring up at most this many of the target's nodes (default: as many as fit).
        cpus_per_node, object_store_mb: per testbed node, as for ``testbed up``.
        mem_available_mb: memory available on this machine (limits the node count).

    Raises:
        ConfigError: a dilation below 1, a rate outside 1mbit..100gbit, more nodes asked for
            than the target has, or nodes brought up that hold no worker.
    """
    problems = []
    if not (isinstance(dilation, (int, float)) and 1 <= dilation <= 10_000):
        problems.append(f"--dilation must be a number in [1, 10000] (links run at the target's bandwidth / K), "
                        f"got {dilation!r}")
    if nodes is not None and not 1 <= nodes <= len(target.nodes):
        problems.append(f"--nodes {nodes} with --like: the target {target.name} has {len(target.nodes)} nodes; "
                        f"give 1..{len(target.nodes)} or leave --nodes out")
    if problems:
        raise ConfigError(problems)
    fit = nodes_that_fit(object_store_mb, mem_available_mb)
    count = min(nodes or len(target.nodes), fit)
    kept, dropped = target.nodes[:count], tuple(n.name for n in target.nodes[count:])
    rates = []
    for n in kept:
        bps = round(n.bandwidth_gbps * 1e9 / dilation)
        try:
            rates.append(format_rate(parse_rate(format_rate(bps))))
        except ConfigError:
            raise ConfigError(f"node {n.name}: {n.bandwidth_gbps:g} Gbit/s / {dilation:g} = {bps} bit/s is outside "
                              f"the 1mbit..100gbit the testbed shapes; choose --dilation so the rate lands in "
                              f"between (e.g. {max(1.0, n.bandwidth_gbps / 0.2):g} for 200mbit)") from None
    workers = [n.workers or 0 for n in kept]
    if not any(workers):
        raise ConfigError(f"the {count} node(s) of {target.name} brought up ({', '.join(n.name for n in kept)}) hold "
                          f"no worker; bring up more of its nodes (--nodes, memory) or list a worker node first")
    notes = []
    if dropped:
        why = "--nodes" if nodes is not None and nodes <= fit else "memory or the 16-node limit"
        notes.append(f"{target.name} has {len(target.nodes)} nodes; {count} are brought up ({why}); "
                     f"dropped: {', '.join(dropped)}")
    fastest = max(rates, key=parse_rate)
    if parse_rate(fastest) > FAITHFUL_RATE_BPS:
        top = max(n.bandwidth_gbps for n in kept)
        notes.append(f"links at {fastest} are faster than this machine emulates faithfully "
                     f"(~{format_rate(FAITHFUL_RATE_BPS)}); raise --dilation to {top:g} or more")
    config = TestbedConfig(nodes=count, bandwidth=rates[0], cpus_per_node=cpus_per_node,
                           object_store_mb=object_store_mb, workers_per_node=max(workers),
                           compute_dilation=float(dilation), like=target.name,
                           node_bandwidths=tuple(rates) if len(set(rates)) > 1 else (),
                           node_workers=tuple(workers) if len(set(workers)) > 1 else ())
    return LikePlan(config, target.name, dropped, tuple(notes))


def oversubscription_warning(config: TestbedConfig, cores: int) -> str | None:
    """A warning when the testbed's workers outnumber the machine's cores (then real compute, not
    the network, decides step times)."""
    workers = sum(config.workers_of)
    if workers <= cores:
        return None
    shape = (f"{config.nodes} nodes x {config.workers_per_node}" if not config.node_workers else
             f"{' + '.join(map(str, config.node_workers))} on {config.nodes} nodes")
    return (f"{workers} workers ({shape}) on {cores} cores: with real "
            f"(TensorFlow) compute the CPUs, not the links, decide the step times; measure with --compute emulated "
            f"on this shape")
