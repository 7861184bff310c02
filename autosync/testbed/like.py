"""A testbed shaped like a cluster that cannot be built here (``testbed up --like FILE --dilation K``).

The target's nodes (as many as fit) each become a namespace with the target's workers per node;
every link runs at the target's bandwidth / K, and the written ClusterSpec records
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
        target: the cluster to imitate (its nodes must share one bandwidth).
        dilation: K >= 1: link rate = target bandwidth / K, emulated compute K times slower.
        nodes: bring up at most this many of the target's nodes (default: as many as fit).
        cpus_per_node, object_store_mb: per testbed node, as for ``testbed up``.
        mem_available_mb: memory available on this machine (limits the node count).

    Raises:
        ConfigError: mixed bandwidths, a dilation below 1, a rate outside 1mbit..100gbit, or
            more nodes asked for than the target has.
    """
    problems = []
    if not (isinstance(dilation, (int, float)) and 1 <= dilation <= 10_000):
        problems.append(f"--dilation must be a number in [1, 10000] (links run at the target's bandwidth / K), "
                        f"got {dilation!r}")
    rates = sorted({n.bandwidth_gbps for n in target.nodes})
    if len(rates) > 1:
        problems.append(f"cluster {target.name} mixes node bandwidths {rates} Gbit/s; the testbed shapes every "
                        f"host alike: give it a cluster whose nodes share one bandwidth_gbps")
    if nodes is not None and not 1 <= nodes <= len(target.nodes):
        problems.append(f"--nodes {nodes} with --like: the target {target.name} has {len(target.nodes)} nodes; "
                        f"give 1..{len(target.nodes)} or leave --nodes out")
    workers = sorted({n.workers or 0 for n in target.nodes})
    if problems:
        raise ConfigError(problems)
    bps = round(rates[0] * 1e9 / dilation)
    try:
        parse_rate(format_rate(bps))
    except ConfigError:
        raise ConfigError(f"{rates[0]:g} Gbit/s / {dilation:g} = {bps} bit/s is outside the 1mbit..100gbit the "
                          f"testbed shapes; choose --dilation so the rate lands in between "
                          f"(e.g. {max(1.0, rates[0] / 0.2):g} for 200mbit)") from None
    fit = nodes_that_fit(object_store_mb, mem_available_mb)
    count = min(nodes or len(target.nodes), fit)
    notes = []
    dropped = tuple(n.name for n in target.nodes[count:])
    if dropped:
        why = "--nodes" if nodes is not None and nodes <= fit else "memory or the 16-node limit"
        notes.append(f"{target.name} has {len(target.nodes)} nodes; {count} are brought up ({why}); "
                     f"dropped: {', '.join(dropped)}")
    if bps > FAITHFUL_RATE_BPS:
        notes.append(f"links at {format_rate(bps)} are faster than this machine emulates faithfully "
                     f"(~{format_rate(FAITHFUL_RATE_BPS)}); raise --dilation to {rates[0]:g} or more")
    config = TestbedConfig(nodes=count, bandwidth=format_rate(bps), cpus_per_node=cpus_per_node,
                           object_store_mb=object_store_mb, workers_per_node=max(1, max(workers)),
                           compute_dilation=float(dilation), like=target.name)
    if len(workers) > 1:
        notes.append(f"{target.name} has {workers} workers per node; every testbed node gets {max(workers)}")
    return LikePlan(config, target.name, dropped, tuple(notes))


def oversubscription_warning(config: TestbedConfig, cores: int) -> str | None:
    """A warning when the testbed's workers outnumber the machine's cores (then real compute, not
    the network, decides step times)."""
    workers = config.nodes * config.workers_per_node
    if workers <= cores:
        return None
    return (f"{workers} workers ({config.nodes} nodes x {config.workers_per_node}) on {cores} cores: with real "
            f"(TensorFlow) compute the CPUs, not the links, decide the step times; measure with --compute emulated "
            f"on this shape")
