"""ClusterSpec: the plain data the tuner needs about a cluster (its nodes, bandwidths, calibration
and compute mode).

A frozen dataclass that validates itself on construction, reads and writes plain mappings
(``from_dict``/``to_dict``, strict about unknown keys) and has a stable ``fingerprint``.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from .calibration import Calibration
from .errors import ConfigError, listed_names, short_repr
from .strict import check_header, check_keys, fingerprint, get_typed, parse_items

# plausibility caps: far above real machines, low enough that nothing downstream overflows or
# tries to start that many processes (whether a node can run its workers is checked before Ray)
MAX_CPUS = 2**16
MAX_GPUS = 2**10
MAX_WORKERS = 2**10
MAX_BANDWIDTH_GBPS = 1e5
MAX_MEMORY_GIB = 2.0**20   # 1 PiB
# what the cost model takes for the bandwidth between the workers of one node when the cluster does
# not give ``intra_node_bandwidth_gbps``: the path of this project's CPU workers and parameter servers
# on one node (host memory, the local object store). The GPUs of a node talk over their own links,
# 100 Gbit/s (PCIe 3.0 x16) to 7200 Gbit/s (H100/H200 NVLink): no default fits them all
# (``ClusterSpec.intra_node_assumption`` says so)
DEFAULT_INTRA_GBPS = 40.0


def _bandwidth_ok(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 < value <= MAX_BANDWIDTH_GBPS)   # NaN and inf fail the comparisons

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class NodeSpec:
    """One machine of the cluster.

    Attributes:
        name: unique node name; strategies refer to it (``PS.destination``, replicas ``name:i``).
        address: IP address of the Ray node (binding by address).
        cpus, gpus: resources of the node.
        workers: training replicas on this node (default: one per GPU, else one).
        chief: the node the driver and default PS run on.
        bandwidth_gbps: NIC bandwidth in Gbit/s, each direction.
        resource: optional custom Ray resource label that pins actors to this node (used
            instead of the address when set, e.g. ``host1`` on the emulated testbed).
        memory_gib: the node's memory in GiB (2^30 bytes), or None (not known: not checked). A
            strategy whose floor there is larger is refused (``strategy_space.memory``). Not part
            of the fingerprint, as a node's memory does not change a step's time.
        gpu_memory_gib: the memory of each of its GPUs in GiB, or None (not checked; unused on a node
            without GPUs, e.g. a GPU cluster's spec with ``gpus`` set to 0).
    """

    name: str
    address: str = "127.0.0.1"
    cpus: int = 1
    gpus: int = 0
    workers: int | None = None
    chief: bool = False
    bandwidth_gbps: float = 10.0
    resource: str | None = None
    memory_gib: float | None = None
    gpu_memory_gib: float | None = None

    def __post_init__(self):
        problems = []
        if not (isinstance(self.name, str) and _NAME_RE.match(self.name)):
            problems.append(f"node name {short_repr(self.name)} must be non-empty and use only letters, digits, "
                            f"'_', '-', '.'")
        if not (isinstance(self.cpus, int) and 1 <= self.cpus <= MAX_CPUS):
            problems.append(f"node {self.name}: cpus must be an integer from 1 to {MAX_CPUS}, got {short_repr(self.cpus)}")
        if not (isinstance(self.gpus, int) and 0 <= self.gpus <= MAX_GPUS):
            problems.append(f"node {self.name}: gpus must be an integer from 0 to {MAX_GPUS}, got {short_repr(self.gpus)}")
        if self.workers is None:
            if isinstance(self.gpus, int):
                object.__setattr__(self, "workers", self.gpus if self.gpus > 0 else 1)
        elif not (isinstance(self.workers, int) and 0 <= self.workers <= MAX_WORKERS):
            problems.append(f"node {self.name}: workers must be an integer from 0 to {MAX_WORKERS}, got "
                            f"{short_repr(self.workers)}")
        if not _bandwidth_ok(self.bandwidth_gbps):
            problems.append(f"node {self.name}: bandwidth_gbps must be a number > 0 and at most {MAX_BANDWIDTH_GBPS:g} "
                            f"(Gbit/s, e.g. 10 or 1e1), got {short_repr(self.bandwidth_gbps)}")
        for key in ("memory_gib", "gpu_memory_gib"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and 0 < value <= MAX_MEMORY_GIB):
                problems.append(f"node {self.name}: {key} must be a number of GiB > 0 and at most "
                                f"{MAX_MEMORY_GIB:.0f}, or left out, got {short_repr(value)}")
        if problems:
            raise ConfigError(problems)

    @property
    def devices(self) -> tuple[str, ...]:
        """Replica slots of this node: ``name:0``, ``name:1``, ..."""
        return tuple(f"{self.name}:{i}" for i in range(self.workers or 0))

    def to_dict(self) -> dict:
        d: dict[str, Any] = {
            "name": self.name, "address": self.address, "cpus": self.cpus, "gpus": self.gpus,
            "workers": self.workers, "bandwidth_gbps": float(self.bandwidth_gbps),
        }
        if self.chief:
            d["chief"] = True
        if self.resource is not None:
            d["resource"] = self.resource
        for key in ("memory_gib", "gpu_memory_gib"):
            if getattr(self, key) is not None:
                d[key] = float(getattr(self, key))
        return d

    @classmethod
    def from_dict(cls, data: Mapping, where: str = "node") -> "NodeSpec":
        check_keys(data, where, {"name"}, {"address", "cpus", "gpus", "workers", "chief", "bandwidth_gbps", "resource",
                                           "memory_gib", "gpu_memory_gib"})
        name = get_typed(data, "name", str, where)
        where = f"node {name}"
        return cls(
            name=name,
            address=get_typed(data, "address", str, where, "127.0.0.1"),
            cpus=get_typed(data, "cpus", int, where, 1),
            gpus=get_typed(data, "gpus", int, where, 0),
            workers=get_typed(data, "workers", (int, type(None)), where, None),
            chief=get_typed(data, "chief", bool, where, False),
            bandwidth_gbps=float(get_typed(data, "bandwidth_gbps", (int, float), where, 10.0)),
            resource=get_typed(data, "resource", (str, type(None)), where, None),
            memory_gib=get_typed(data, "memory_gib", (int, float, type(None)), where, None),
            gpu_memory_gib=get_typed(data, "gpu_memory_gib", (int, float, type(None)), where, None),
        )


@dataclass(frozen=True)
class ClusterSpec:
    """The machines training runs on.

    Attributes:
        name: cluster name.
        nodes: the nodes; exactly one is the chief (the first one when none is marked).
        intra_node_bandwidth_gbps: bandwidth between workers of one node, Gbit/s (None: the cost model
            takes ``DEFAULT_INTRA_GBPS``, see ``intra_node_assumption``).
        calibration: measured communication costs (``autosync calibrate``), or None. Not part of
            the fingerprint: measuring a cluster does not make it another cluster.
        compute: ``real`` (workers run the model) or ``emulated`` (workers wait the profiled
            compute time and send synthetic gradients); trials of the two never share a group.
        compute_dilation: emulated compute runs this many times slower than the profile (a testbed
            whose links run K times slower than the cluster it stands for keeps its
            communication-to-compute ratio with dilation K).
        shared_memory_gib: the nodes share one machine with this much memory in GiB (the testbed's
            network namespaces), or None: what they hold together must fit it
            (``strategy_space.memory``). Not part of the fingerprint.
    """

    name: str
    nodes: tuple[NodeSpec, ...]
    intra_node_bandwidth_gbps: float | None = None
    calibration: Calibration | None = None
    compute: str = "real"
    compute_dilation: float = 1.0
    shared_memory_gib: float | None = None
    _index: dict = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self):
        nodes = tuple(self.nodes)
        problems = []
        if not nodes:
            problems.append(f"cluster {self.name}: needs at least one node")
        names = [n.name for n in nodes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            problems.append(f"cluster {self.name}: node names must be unique, repeated: {', '.join(dup)}")
        chiefs = [n.name for n in nodes if n.chief]
        if len(chiefs) > 1:
            problems.append(f"cluster {self.name}: exactly one node may be chief, got {', '.join(chiefs)}")
        if nodes and sum(n.workers or 0 for n in nodes) < 1:
            problems.append(f"cluster {self.name}: no node has workers; set workers >= 1 on at least one node")
        if self.intra_node_bandwidth_gbps is not None and not _bandwidth_ok(self.intra_node_bandwidth_gbps):
            problems.append(f"cluster {self.name}: intra_node_bandwidth_gbps must be a number > 0 and at most "
                            f"{MAX_BANDWIDTH_GBPS:g}, got {short_repr(self.intra_node_bandwidth_gbps)}")
        if self.compute not in ("real", "emulated"):
            problems.append(f"cluster {self.name}: compute must be 'real' or 'emulated', got {self.compute!r}")
        if not (isinstance(self.compute_dilation, (int, float)) and 1 <= self.compute_dilation <= 10_000):
            problems.append(f"cluster {self.name}: compute_dilation must be a number in [1, 10000], "
                            f"got {self.compute_dilation!r}")
        shared = self.shared_memory_gib
        if shared is not None and not (isinstance(shared, (int, float)) and not isinstance(shared, bool)
                                       and 0 < shared <= MAX_MEMORY_GIB):
            problems.append(f"cluster {self.name}: shared_memory_gib must be a number of GiB > 0 and at most "
                            f"{MAX_MEMORY_GIB:.0f}, or left out, got {short_repr(shared)}")
        if problems:
            raise ConfigError(problems)
        if not chiefs:
            nodes = (replace(nodes[0], chief=True),) + nodes[1:]
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "_index", {n.name: i for i, n in enumerate(nodes)})

    @property
    def intra_node_gbps(self) -> float:
        """The bandwidth between the workers of one node that the cost model uses: the cluster's own
        figure, else ``DEFAULT_INTRA_GBPS``."""
        return self.intra_node_bandwidth_gbps or DEFAULT_INTRA_GBPS

    def assumptions(self) -> list[str]:
        """Every figure a prediction for this cluster takes on trust, each with how to give it
        (``plan``, ``simulate`` and ``tune`` print them)."""
        return [a for a in (self.intra_node_assumption(), self.gpu_memory_assumption()) if a]

    def gpu_memory_assumption(self) -> str | None:
        """What is not checked for want of a figure: the memory of the GPUs of nodes that train on
        GPUs and give no ``gpu_memory_gib`` (a strategy too large for them fails at its first step
        instead of being refused); None where every such node gives it."""
        unknown = [n.name for n in self.nodes if n.gpus > 0 and (n.workers or 0) > 0 and n.gpu_memory_gib is None]
        if not unknown:
            return None
        named = ", ".join(unknown[:4]) + (f" and {len(unknown) - 4} more" if len(unknown) > 4 else "")
        return (f"GPU memory not checked on {named} (cluster {self.name} gives no gpu_memory_gib there): a strategy "
                f"too large for a GPU fails at its first step instead of being refused; set gpu_memory_gib per node "
                f"in the cluster YAML (ray?gpu_gib=X for --cluster ray)")

    def intra_node_assumption(self) -> str | None:
        """What a prediction for this cluster takes on trust about the links inside a node, for the
        user to correct: said where a node runs several GPU workers and the cluster gives no
        ``intra_node_bandwidth_gbps`` (their all-reduce, flat or hierarchical, crosses those links, and
        GPU links differ 70-fold between machines); None otherwise."""
        if self.intra_node_bandwidth_gbps is not None:
            return None
        gpu_workers = max(((n.workers or 0) for n in self.nodes if n.gpus > 0), default=0)
        if gpu_workers < 2:
            return None
        return (f"intra-node bandwidth {DEFAULT_INTRA_GBPS:g} Gbit/s between the up to {gpu_workers} GPU workers of a "
                f"node (cluster {self.name} gives no intra_node_bandwidth_gbps, and it decides what a flat or "
                f"hierarchical all-reduce costs there): set it in the cluster YAML, e.g. 100 for PCIe 3.0 x16, "
                f"2400 for V100 NVLink, 7200 for H100/H200 NVLink (ray?intra_gbps=X for --cluster ray)")

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)

    def node_index(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"cluster {self.name} has no node {short_repr(name)}; nodes: "
                           f"{listed_names(self.node_names)}") from None

    def node(self, name: str) -> NodeSpec:
        return self.nodes[self.node_index(name)]

    @property
    def chief(self) -> NodeSpec:
        return next(n for n in self.nodes if n.chief)

    @property
    def devices(self) -> tuple[str, ...]:
        """Every replica slot, ``node:i``, in node order."""
        return tuple(d for n in self.nodes for d in n.devices)

    @property
    def num_workers(self) -> int:
        return len(self.devices)

    @functools.cached_property   # the spec is frozen: hashed once per object
    def fingerprint(self) -> str:
        d = self.to_dict()
        d.pop("name")
        d.pop("calibration", None)
        d.pop("shared_memory_gib", None)
        for node in d["nodes"]:   # a node's memory decides what fits, not how fast it runs
            node.pop("memory_gib", None)
            node.pop("gpu_memory_gib", None)
        return fingerprint(d)

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"kind": "cluster", "version": 1, "name": self.name,
                             "nodes": [n.to_dict() for n in self.nodes]}
        if self.intra_node_bandwidth_gbps is not None:
            d["intra_node_bandwidth_gbps"] = float(self.intra_node_bandwidth_gbps)
        if self.calibration is not None:
            d["calibration"] = self.calibration.to_dict()
        # written only when set, so the fingerprints of real-compute clusters stay as they were
        if self.compute != "real":
            d["compute"] = self.compute
        if self.compute_dilation != 1:
            d["compute_dilation"] = float(self.compute_dilation)
        if self.shared_memory_gib is not None:
            d["shared_memory_gib"] = float(self.shared_memory_gib)
        return d

    @classmethod
    def from_dict(cls, data: Mapping) -> "ClusterSpec":
        check_keys(data, "cluster", {"name", "nodes"},
                   {"kind", "version", "intra_node_bandwidth_gbps", "calibration", "compute", "compute_dilation",
                    "shared_memory_gib"})
        check_header(data, "cluster")
        nodes = parse_items(get_typed(data, "nodes", list, "cluster"), NodeSpec.from_dict, "nodes")
        intra = get_typed(data, "intra_node_bandwidth_gbps", (int, float, type(None)), "cluster", None)
        cal = get_typed(data, "calibration", (Mapping, type(None)), "cluster", None)
        return cls(name=get_typed(data, "name", str, "cluster"), nodes=tuple(nodes),
                   intra_node_bandwidth_gbps=float(intra) if intra is not None else None,
                   calibration=Calibration.from_dict(cal) if cal is not None else None,
                   compute=get_typed(data, "compute", str, "cluster", "real"),
                   compute_dilation=float(get_typed(data, "compute_dilation", (int, float), "cluster", 1.0)),
                   shared_memory_gib=get_typed(data, "shared_memory_gib", (int, float, type(None)), "cluster", None))
