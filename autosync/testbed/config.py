"""What a testbed is made of: node count, link rate, per-node Ray resources, and the names and
addresses derived from them.

Pure data and parsing; nothing here touches the system.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from strategy_space.errors import ConfigError, Problems

SWITCH_NS = "autosync-sw"
BRIDGE = "br0"
SUBNET_PREFIX = "10.77.0."
HEAD_PORT = 6379
MAX_NODES = 16
MIN_RATE_BPS = 1_000_000
MAX_RATE_BPS = 100_000_000_000
# "none" leaves the veths unshaped; they then run as fast as the CPUs copy (several Gbit/s, noisy).
# The ClusterSpec still needs a number, so it records this nominal speed.
UNSHAPED_GBPS = 10.0
UNLIMITED = ("none", "unlimited")

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$")


class TestbedError(RuntimeError):
    """The system did not do what the testbed asked (a command failed, Ray did not come up).

    Raised after the testbed has cleaned up what it made; the message says what failed and where
    the logs are.
    """

    __test__ = False  # not a pytest test class despite the name


def parse_rate(text: str) -> int | None:
    """Bits per second of a tc-style rate.

    Args:
        text: ``none`` (or ``unlimited``) for no shaping, or a number with a unit of bits per
            second: ``bit``, ``kbit``, ``mbit``, ``gbit`` or ``tbit`` (``200mbit``, ``1.5gbit``).
            Byte units such as tc's ``mbps`` are refused on purpose: they are easy to misread.

    Returns:
        The rate in bit/s, or None for no shaping.

    Raises:
        ConfigError: not a rate, an unknown unit, or outside 1mbit..100gbit.
    """
    if not isinstance(text, str):
        raise ConfigError(f"bandwidth must be a string such as 1gbit, 200mbit or none, got {text!r}")
    low = text.strip().lower()
    if low in UNLIMITED:
        return None
    m = _RATE_RE.match(low)
    if not m:
        raise ConfigError(f"bandwidth {text!r} is not a rate; give a number and a unit such as 1gbit, "
                          f"200mbit, 500kbit, or none for no limit")
    value, unit = m.groups()
    if unit not in _UNITS:
        raise ConfigError(f"bandwidth {text!r}: unit {unit!r} is not one of {', '.join(_UNITS)} "
                          f"(bits per second; byte units such as mbps are not accepted)")
    bps = round(float(value) * _UNITS[unit])
    if not MIN_RATE_BPS <= bps <= MAX_RATE_BPS:
        raise ConfigError(f"bandwidth {text!r} = {bps} bit/s is outside the supported range 1mbit..100gbit")
    return bps


def format_rate(bps: int | None) -> str:
    """The shortest exact text for a rate: ``1gbit``, ``200mbit``, ``1500kbit``, or ``none``."""
    if bps is None:
        return "none"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bps % _UNITS[unit] == 0:
            return f"{bps // _UNITS[unit]}{unit}"
    return f"{bps}bit"


def rate_gbps(bps: int | None) -> float:
    """Gbit/s for a ClusterSpec: the shaped rate, or ``UNSHAPED_GBPS`` when unshaped."""
    return UNSHAPED_GBPS if bps is None else bps / 1e9


BURST_S = 0.5e-3     # the token bucket: half a millisecond of the link rate ...
BURST_MIN = 8192     # ... and at least this (two of the smallest super-packets below)
GSO_MAX = 65536      # the kernel's largest GSO super-packet


def burst_bytes(bps: int) -> int:
    """Token-bucket burst for a rate: 0.5 ms worth of bytes, at least 8 KiB.

    A physical link serializes every byte at its rate; a bucket lets its size through at once
    after an idle moment, so a step that pushes and then pulls (a synchronous parameter server)
    crosses each phase up to ``burst / rate`` faster than the link could. Until 2026-11-28 the
    bucket was 128 KiB at any rate (5 ms at 200mbit): a 93 KB push then a 91 KB reply took
    3.9 ms a round where 200 Mbit/s needs 7.4 ms, and small models' PS steps measured below
    their lower bound. With half a millisecond the same round takes 6.6 ms, and bulk transfers
    still hold the rate (8 MB at 200mbit in 335 ms, 20 MB at 1gbit in 168 ms) because GSO
    super-packets are kept to half the bucket (``gso_bytes``).
    """
    return max(BURST_MIN, int(bps * BURST_S / 8))


def gso_bytes(bps: int) -> int:
    """Largest GSO super-packet on a shaped link: half the bucket (``burst_bytes``), so that two
    fit in it and the shaper keeps the rate; 64 KiB (the kernel's most) from about 1 Gbit/s up."""
    return min(GSO_MAX, burst_bytes(bps) // 2)


def host_ns(i: int) -> str:
    """Namespace (and Ray resource label) of node ``i``."""
    return f"host{i}"


def host_address(i: int) -> str:
    """IPv4 address of node ``i`` on the testbed LAN."""
    return f"{SUBNET_PREFIX}{i + 1}"


def head_address() -> str:
    """``ip:port`` of the Ray head (GCS) in host0."""
    return f"{host_address(0)}:{HEAD_PORT}"


@dataclass(frozen=True)
class TestbedConfig:
    """The shape of an emulated cluster.

    Attributes:
        nodes: number of hosts (namespaces, one Ray node each), 1..16.
        bandwidth: per-host rate each direction, e.g. ``1gbit``, ``200mbit`` or ``none``; a
            comma-separated list (``500mbit,100mbit``) sets ``node_bandwidths``.
        cpus_per_node: logical CPUs each Ray node advertises (``--num-cpus``).
        object_store_mb: object store of each Ray node, in MiB (>= 100).
        workers_per_node: training replicas each node's ClusterSpec entry gets.
        node_bandwidths: per host (host0 first), its own rate instead of ``bandwidth``: a testbed
            shaped like a cluster whose nodes differ (``--like``); empty: every host at ``bandwidth``.
        node_workers: per host, its own worker count instead of ``workers_per_node`` (0: a host
            that only holds parameter servers); empty: ``workers_per_node`` each.
        compute_dilation: recorded in the ClusterSpec: emulated compute runs this many times
            slower (``--like ... --dilation K``).
        like: name of the cluster this testbed stands for (``--like``), or None.
    """

    __test__ = False  # not a pytest test class despite the name

    nodes: int = 3
    bandwidth: str = "1gbit"
    cpus_per_node: int = 1
    object_store_mb: int = 1000
    workers_per_node: int = 1
    compute_dilation: float = 1.0
    like: str | None = None
    node_bandwidths: tuple = ()
    node_workers: tuple = ()

    def __post_init__(self):
        problems = Problems()
        if not (isinstance(self.nodes, int) and 1 <= self.nodes <= MAX_NODES):
            problems.add(f"nodes must be an integer in 1..{MAX_NODES}, got {self.nodes!r}")
        if not (isinstance(self.cpus_per_node, int) and self.cpus_per_node >= 1):
            problems.add(f"cpus_per_node must be an integer >= 1, got {self.cpus_per_node!r}")
        if not (isinstance(self.workers_per_node, int) and self.workers_per_node >= 1):
            problems.add(f"workers_per_node must be an integer >= 1, got {self.workers_per_node!r}")
        if not (isinstance(self.compute_dilation, (int, float)) and 1 <= self.compute_dilation <= 10_000):
            problems.add(f"compute_dilation must be a number in [1, 10000], got {self.compute_dilation!r}")
        if not (isinstance(self.object_store_mb, int) and self.object_store_mb >= 100):
            problems.add(f"object_store_mb must be an integer >= 100 (Ray needs at least ~75 MiB), "
                         f"got {self.object_store_mb!r}")
        if isinstance(self.bandwidth, str) and "," in self.bandwidth and not self.node_bandwidths:
            # "500mbit,100mbit": a rate per host, host0 first (``testbed up --bandwidth``, the benchmarks' flag)
            each = tuple(b.strip() for b in self.bandwidth.split(","))
            object.__setattr__(self, "node_bandwidths", each)
            object.__setattr__(self, "bandwidth", each[0])
        try:
            # one spelling per rate (1000mbit -> 1gbit), so states and specs compare equal
            object.__setattr__(self, "bandwidth", format_rate(parse_rate(self.bandwidth)))
            object.__setattr__(self, "node_bandwidths", tuple(format_rate(parse_rate(b))
                                                              for b in self.node_bandwidths))
        except (ConfigError, TypeError) as e:
            problems.items.extend(getattr(e, "problems", [str(e)]))
        workers = tuple(self.node_workers)
        object.__setattr__(self, "node_workers", workers)
        for name, given in (("node_bandwidths", self.node_bandwidths), ("node_workers", workers)):
            if given and isinstance(self.nodes, int) and len(given) != self.nodes:
                problems.add(f"{name} must give one value per node ({self.nodes}), got {len(given)}")
        if workers and not (all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in workers)
                            and sum(workers) >= 1):
            problems.add(f"node_workers must be integers >= 0 with at least one worker in all, got {list(workers)}")
        problems.raise_if_any()

    @property
    def rates_bps(self) -> tuple:
        """Each host's rate in bit/s (None: unshaped), host0 first."""
        return tuple(parse_rate(b) for b in self.node_bandwidths) or (self.rate_bps,) * self.nodes

    @property
    def workers_of(self) -> tuple[int, ...]:
        """Each host's worker count, host0 first."""
        return self.node_workers or (self.workers_per_node,) * self.nodes

    @property
    def links(self) -> str:
        """The links in words: ``200mbit``, or per host where they differ (``host0 500mbit, host1 ...``)."""
        if len(set(self.node_bandwidths)) < 2:
            return self.node_bandwidths[0] if self.node_bandwidths else self.bandwidth
        return ", ".join(f"{host_ns(i)} {b}" for i, b in enumerate(self.node_bandwidths))

    @property
    def rate_bps(self) -> int | None:
        return parse_rate(self.bandwidth)

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Host namespaces, host0 first."""
        return tuple(host_ns(i) for i in range(self.nodes))
