"""ModelSpec and ClusterSpec: the plain data the tuner needs about a model and a cluster.

Both are frozen dataclasses that validate themselves on construction, read and write plain
mappings (``from_dict``/``to_dict``, strict about unknown keys) and have a stable ``fingerprint``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ._strict import check_keys, fingerprint, get_typed, parse_items
from ._yaml_limits import short_repr
from .calibration import Calibration
from .errors import ConfigError

DTYPE_BYTES = {
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class VariableSpec:
    """One trainable variable.

    Attributes:
        name: unique name (Keras path such as ``dense/kernel``).
        shape: static shape.
        dtype: one of ``DTYPE_BYTES``.
        sparse: the gradient is ``IndexedSlices`` (an embedding lookup).
        rows_per_step: for sparse variables, unique rows touched per step per worker.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    sparse: bool = False
    rows_per_step: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        problems = []
        if not self.name or not isinstance(self.name, str):
            problems.append(f"variable name must be a non-empty string, got {short_repr(self.name)}")
        if any(d < 1 for d in self.shape):
            problems.append(f"variable {self.name}: every dimension of shape must be >= 1, got {list(self.shape)}")
        if self.dtype not in DTYPE_BYTES:
            problems.append(f"variable {self.name}: dtype {short_repr(self.dtype)} is not one of "
                            f"{', '.join(DTYPE_BYTES)}")
        if self.sparse and not self.shape:
            problems.append(f"variable {self.name}: a sparse variable needs at least one dimension")
        if self.rows_per_step is not None:
            if not self.sparse:
                problems.append(f"variable {self.name}: rows_per_step is only allowed when sparse is true")
            elif not 1 <= self.rows_per_step <= self.shape[0]:
                problems.append(
                    f"variable {self.name}: rows_per_step must be in [1, {self.shape[0]}] (rows), got {self.rows_per_step}"
                )
        if problems:
            raise ConfigError(problems)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes(self) -> int:
        return self.size * DTYPE_BYTES[self.dtype]

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (slice along axis 0)."""
        return self.bytes // self.shape[0] if self.shape else self.bytes

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        if self.sparse:
            d["sparse"] = True
        if self.rows_per_step is not None:
            d["rows_per_step"] = self.rows_per_step
        return d

    @classmethod
    def from_dict(cls, data: Mapping, where: str = "variable") -> "VariableSpec":
        check_keys(data, where, {"name", "shape"}, {"dtype", "sparse", "rows_per_step", "bytes"})
        name = get_typed(data, "name", str, where)
        where = f"variable {name}"
        shape = get_typed(data, "shape", list, where)
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise ConfigError(f"{where}.shape: expected a list of integers, got {short_repr(shape)}")
        spec = cls(
            name=name,
            shape=tuple(shape),
            dtype=get_typed(data, "dtype", str, where, "float32"),
            sparse=get_typed(data, "sparse", bool, where, False),
            rows_per_step=get_typed(data, "rows_per_step", (int, type(None)), where, None),
        )
        if "bytes" in data and data["bytes"] != spec.bytes:
            raise ConfigError(f"{where}.bytes: {short_repr(data['bytes'])} does not match shape x dtype = {spec.bytes}")
        return spec


@dataclass(frozen=True)
class ComputeProfile:
    """Measured forward+backward cost of one training step on one worker.

    Attributes:
        step_time_s: median compute time of one step (no synchronization).
        device: what it was measured on (e.g. ``cpu:2 cores``).
        ready_order: variable names in the order their gradients become ready in the backward
            pass (empty: unknown, assume reverse creation order).
    """

    step_time_s: float
    device: str = "unknown"
    ready_order: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "ready_order", tuple(self.ready_order))
        if not (isinstance(self.step_time_s, (int, float)) and self.step_time_s >= 0 and math.isfinite(self.step_time_s)):
            raise ConfigError(f"profile.step_time_s must be a finite number >= 0, got {short_repr(self.step_time_s)}")

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"step_time_s": float(self.step_time_s), "device": self.device}
        if self.ready_order:
            d["ready_order"] = list(self.ready_order)
        return d

    @classmethod
    def from_dict(cls, data: Mapping, where: str = "profile") -> "ComputeProfile":
        check_keys(data, where, {"step_time_s"}, {"device", "ready_order"})
        return cls(
            step_time_s=float(get_typed(data, "step_time_s", (int, float), where)),
            device=get_typed(data, "device", str, where, "unknown"),
            ready_order=tuple(get_typed(data, "ready_order", list, where, [])),
        )


@dataclass(frozen=True)
class ModelSpec:
    """Ordered trainable variables of a model plus, optionally, its measured compute profile.

    Attributes:
        name: model name (e.g. ``ncf`` or ``zoo:ncf?size=small``).
        variables: in creation order.
        batch_size: per-worker batch size the sparse row counts and the profile refer to.
        profile: measured compute cost, or None (the simulator then estimates it).
    """

    name: str
    variables: tuple[VariableSpec, ...]
    batch_size: int = 32
    profile: ComputeProfile | None = None

    def __post_init__(self):
        object.__setattr__(self, "variables", tuple(self.variables))
        problems = []
        if not self.variables:
            problems.append(f"model {self.name}: has no trainable variables")
        seen: set[str] = set()
        for v in self.variables:
            if v.name in seen:
                problems.append(f"model {self.name}: variable name {short_repr(v.name)} appears twice; names "
                                f"must be unique")
            seen.add(v.name)
        if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            problems.append(f"model {self.name}: batch_size must be an integer >= 1, got {short_repr(self.batch_size)}")
        if self.profile is not None and self.profile.ready_order:
            order = self.profile.ready_order
            if sorted(order) != sorted(seen):
                missing = sorted(seen - set(order))[:5]
                extra = sorted(set(order) - seen)[:5]
                problems.append(
                    f"model {self.name}: profile.ready_order must list every variable exactly once "
                    f"(missing {missing}, unknown {extra})"
                )
        if problems:
            raise ConfigError(problems)
        object.__setattr__(self, "_index", {v.name: i for i, v in enumerate(self.variables)})

    def index(self, name: str) -> int:
        try:
            return self._index[name]  # type: ignore[attr-defined]
        except KeyError:
            raise KeyError(f"model {self.name} has no variable {short_repr(name)}") from None

    def var(self, name: str) -> VariableSpec:
        return self.variables[self.index(name)]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.variables)

    @property
    def total_bytes(self) -> int:
        return sum(v.bytes for v in self.variables)

    @property
    def total_params(self) -> int:
        return sum(v.size for v in self.variables)

    @property
    def sparse_share(self) -> float:
        """Fraction of parameters in sparse (embedding) variables."""
        return sum(v.size for v in self.variables if v.sparse) / max(1, self.total_params)

    @property
    def fingerprint(self) -> str:
        """Hash of what determines communication: variables and batch size, not the profile."""
        return fingerprint({"variables": [v.to_dict() for v in self.variables], "batch_size": self.batch_size})

    def to_dict(self) -> dict:
        d: dict[str, Any] = {
            "kind": "model",
            "version": 1,
            "name": self.name,
            "batch_size": self.batch_size,
            "variables": [v.to_dict() for v in self.variables],
        }
        if self.profile is not None:
            d["profile"] = self.profile.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: Mapping) -> "ModelSpec":
        check_keys(data, "model", {"name", "variables"}, {"kind", "version", "batch_size", "profile"})
        _check_header(data, "model")
        variables = parse_items(get_typed(data, "variables", list, "model"), VariableSpec.from_dict, "variables")
        profile = data.get("profile")
        return cls(
            name=get_typed(data, "name", str, "model"),
            variables=tuple(variables),
            batch_size=get_typed(data, "batch_size", int, "model", 32),
            profile=ComputeProfile.from_dict(profile) if profile is not None else None,
        )


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
    """

    name: str
    address: str = "127.0.0.1"
    cpus: int = 1
    gpus: int = 0
    workers: int | None = None
    chief: bool = False
    bandwidth_gbps: float = 10.0
    resource: str | None = None

    def __post_init__(self):
        problems = []
        if not (isinstance(self.name, str) and _NAME_RE.match(self.name)):
            problems.append(f"node name {short_repr(self.name)} must be non-empty and use only letters, digits, "
                            f"'_', '-', '.'")
        if not (isinstance(self.cpus, int) and self.cpus >= 1):
            problems.append(f"node {self.name}: cpus must be an integer >= 1, got {short_repr(self.cpus)}")
        if not (isinstance(self.gpus, int) and self.gpus >= 0):
            problems.append(f"node {self.name}: gpus must be an integer >= 0, got {short_repr(self.gpus)}")
        if self.workers is None:
            if isinstance(self.gpus, int):
                object.__setattr__(self, "workers", self.gpus if self.gpus > 0 else 1)
        elif not (isinstance(self.workers, int) and self.workers >= 0):
            problems.append(f"node {self.name}: workers must be an integer >= 0, got {short_repr(self.workers)}")
        if not (isinstance(self.bandwidth_gbps, (int, float)) and self.bandwidth_gbps > 0):
            problems.append(f"node {self.name}: bandwidth_gbps must be > 0, got {short_repr(self.bandwidth_gbps)}")
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
        return d

    @classmethod
    def from_dict(cls, data: Mapping, where: str = "node") -> "NodeSpec":
        check_keys(data, where, {"name"}, {"address", "cpus", "gpus", "workers", "chief", "bandwidth_gbps", "resource"})
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
        )


@dataclass(frozen=True)
class ClusterSpec:
    """The machines training runs on.

    Attributes:
        name: cluster name.
        nodes: the nodes; exactly one is the chief (the first one when none is marked).
        intra_node_bandwidth_gbps: bandwidth between workers of one node (None: memory speed).
        calibration: measured communication costs (``autosync calibrate``), or None. Not part of
            the fingerprint: measuring a cluster does not make it another cluster.
        compute: ``real`` (workers run the model) or ``emulated`` (workers wait the profiled
            compute time and send synthetic gradients); trials of the two never share a group.
        compute_dilation: emulated compute runs this many times slower than the profile (a testbed
            whose links run K times slower than the cluster it stands for keeps its
            communication-to-compute ratio with dilation K).
    """

    name: str
    nodes: tuple[NodeSpec, ...]
    intra_node_bandwidth_gbps: float | None = None
    calibration: Calibration | None = None
    compute: str = "real"
    compute_dilation: float = 1.0
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
        if self.intra_node_bandwidth_gbps is not None and not self.intra_node_bandwidth_gbps > 0:
            problems.append(f"cluster {self.name}: intra_node_bandwidth_gbps must be > 0, got {self.intra_node_bandwidth_gbps}")
        if self.compute not in ("real", "emulated"):
            problems.append(f"cluster {self.name}: compute must be 'real' or 'emulated', got {self.compute!r}")
        if not (isinstance(self.compute_dilation, (int, float)) and 1 <= self.compute_dilation <= 10_000):
            problems.append(f"cluster {self.name}: compute_dilation must be a number in [1, 10000], "
                            f"got {self.compute_dilation!r}")
        if problems:
            raise ConfigError(problems)
        if not chiefs:
            nodes = (replace(nodes[0], chief=True),) + nodes[1:]
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "_index", {n.name: i for i, n in enumerate(nodes)})

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)

    def node_index(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"cluster {self.name} has no node {short_repr(name)}; nodes: "
                           f"{', '.join(self.node_names)}") from None

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

    @property
    def fingerprint(self) -> str:
        d = self.to_dict()
        d.pop("name")
        d.pop("calibration", None)
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
        return d

    @classmethod
    def from_dict(cls, data: Mapping) -> "ClusterSpec":
        check_keys(data, "cluster", {"name", "nodes"},
                   {"kind", "version", "intra_node_bandwidth_gbps", "calibration", "compute", "compute_dilation"})
        _check_header(data, "cluster")
        nodes = parse_items(get_typed(data, "nodes", list, "cluster"), NodeSpec.from_dict, "nodes")
        intra = get_typed(data, "intra_node_bandwidth_gbps", (int, float, type(None)), "cluster", None)
        cal = get_typed(data, "calibration", (Mapping, type(None)), "cluster", None)
        return cls(name=get_typed(data, "name", str, "cluster"), nodes=tuple(nodes),
                   intra_node_bandwidth_gbps=float(intra) if intra is not None else None,
                   calibration=Calibration.from_dict(cal) if cal is not None else None,
                   compute=get_typed(data, "compute", str, "cluster", "real"),
                   compute_dilation=float(get_typed(data, "compute_dilation", (int, float), "cluster", 1.0)))


FORMAT_VERSION = 1


def _check_header(data: Mapping, kind: str) -> None:
    if "kind" in data and data["kind"] != kind:
        raise ConfigError(f"expected a {kind} file (kind: {kind}), got kind: {short_repr(data['kind'])}")
    version = data.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise ConfigError(f"{kind} format version {short_repr(version)} is not supported; this AutoSync reads "
                          f"version {FORMAT_VERSION}")
