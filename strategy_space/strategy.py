"""The Strategy: how each trainable variable's gradients are synchronized.

A strategy holds one ``VarConfig`` per variable. A variable is either whole (one synchronizer) or
partitioned along an axis into shards, each shard with its own synchronizer: ``PS`` (parameter
server on a destination node) or ``AllReduce`` (collective, fused by ``group``).
Everything here is frozen and validates its own fields; ``validate`` checks a strategy against a
model and a cluster.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from .compressor import Compressor
from .errors import ConfigError, short_repr
from .strict import (FORMAT_VERSION, MAX_PROBLEMS_KEPT, check_header, check_keys, fingerprint, get_typed,
                     parse_items)

# The all-reduce backends a strategy may name (``AllReduce.backend``): the one registry of their
# names (their order numbers them in the encoding). The runtime maps each but ``auto`` to its
# implementation (``autosync.runtime.sync.backends.BACKENDS``); a test holds the two together.
BACKENDS = ("auto", "gloo", "nccl", "objectstore", "graph")
# backends whose collectives run inside the training step: a tool that calls a backend from numpy
# (``autosync calibrate``) cannot use them
IN_GRAPH_BACKENDS = ("graph",)
# integer fields are encoded as int32 arrays by the tuner and simulator: far above any real value
# (a group per variable shard; a worker ahead by a million steps), far below int32's limit
MAX_GROUP = 2**20 - 1
MAX_STALENESS = 10**6
MAX_SHARDS = 2**16   # per variable (a shard list of this length is still small to hold)


@dataclass(frozen=True)
class PS:
    """Parameter-server synchronization.

    Attributes:
        destination: node that hosts this (shard of the) variable.
        local_replication: one pull per node, shared by the node's workers.
        sync: synchronous (all workers' gradients for step t are applied together).
        staleness: with ``sync``, how many steps a worker may run ahead (0 = fully synchronous).
    """

    destination: str
    local_replication: bool = False
    sync: bool = True
    staleness: int = 0

    def __post_init__(self):
        problems = []
        if not isinstance(self.destination, str) or not self.destination:
            problems.append(f"ps.destination must be a node name, got {short_repr(self.destination)}")
        if (not isinstance(self.staleness, int) or isinstance(self.staleness, bool)
                or not 0 <= self.staleness <= MAX_STALENESS):
            problems.append(f"ps.staleness must be an integer from 0 to {MAX_STALENESS}, got "
                            f"{short_repr(self.staleness)}")
        if problems:
            raise ConfigError(problems)

    def to_dict(self) -> dict:
        return {"ps": {"destination": self.destination, "local_replication": self.local_replication,
                       "sync": self.sync, "staleness": self.staleness}}

    @classmethod
    def from_dict(cls, body: Mapping, where: str) -> "PS":
        where = f"{where}.ps"
        check_keys(body, where, {"destination"}, {"local_replication", "sync", "staleness"})
        return cls(
            destination=get_typed(body, "destination", str, where),
            local_replication=get_typed(body, "local_replication", bool, where, False),
            sync=get_typed(body, "sync", bool, where, True),
            staleness=get_typed(body, "staleness", int, where, 0),
        )


@dataclass(frozen=True)
class AllReduce:
    """Collective synchronization.

    Attributes:
        backend: one of ``BACKENDS``.
        compressor: ``none``, ``fp16``, ``fp16_ef``, ``powersgd(R)`` or ``powersgd_ef(R)``.
        group: fusion group. The members of a group that share backend and compressor are packed
            into one flat buffer and reduced with one collective call per step (normally a group
            is uniform, so one call); groups are issued in gradient-ready order.
        hierarchical: where nodes hold several workers, reduce on the node first, all-reduce among
            one leader per node, then broadcast on the node (only the leaders' traffic crosses the
            NICs). Written to YAML only when true, so existing strategies keep their fingerprints.
    """

    backend: str = "auto"
    compressor: str = "none"
    group: int = 0
    hierarchical: bool = False

    def __post_init__(self):
        problems = []
        if self.backend not in BACKENDS:
            problems.append(f"all_reduce.backend {short_repr(self.backend)} is not one of {', '.join(BACKENDS)}")
        try:
            Compressor.parse(self.compressor)
        except ConfigError as e:
            problems.extend(e.problems)
        if not isinstance(self.group, int) or isinstance(self.group, bool) or not 0 <= self.group <= MAX_GROUP:
            problems.append(f"all_reduce.group must be an integer from 0 to {MAX_GROUP}, got {short_repr(self.group)}")
        if not isinstance(self.hierarchical, bool):
            problems.append(f"all_reduce.hierarchical must be true or false, got {short_repr(self.hierarchical)}")
        if problems:
            raise ConfigError(problems)

    @property
    def codec(self) -> Compressor:
        """The compressor as a value (parsed once per distinct spec)."""
        return Compressor.parse(self.compressor)

    def to_dict(self) -> dict:
        body = {"backend": self.backend, "compressor": self.compressor, "group": self.group}
        if self.hierarchical:
            body["hierarchical"] = True
        return {"all_reduce": body}

    @classmethod
    def from_dict(cls, body: Mapping, where: str) -> "AllReduce":
        where = f"{where}.all_reduce"
        check_keys(body, where, set(), {"backend", "compressor", "group", "hierarchical"})
        return cls(
            backend=get_typed(body, "backend", str, where, "auto"),
            compressor=get_typed(body, "compressor", str, where, "none"),
            group=get_typed(body, "group", int, where, 0),
            hierarchical=get_typed(body, "hierarchical", bool, where, False),
        )


Synchronizer = Union[PS, AllReduce]


def _sync_from_dict(data: Mapping, where: str) -> Synchronizer:
    kinds = [k for k in ("ps", "all_reduce") if k in data]
    if len(kinds) != 1:
        raise ConfigError(f"{where}: needs exactly one synchronizer, 'ps' or 'all_reduce', got "
                          f"{short_repr(sorted(map(str, data))) if data else 'none'}")
    try:
        if kinds[0] == "ps":
            return PS.from_dict(data["ps"], where)
        return AllReduce.from_dict(data["all_reduce"] or {}, where)
    except ConfigError as e:   # the value checks of __post_init__ do not know the variable: name it
        raise ConfigError([p if p.startswith(where) else f"{where}.{kinds[0]}: {p}" for p in e.problems]) from None


_PER_VARIABLE = re.compile(r"^variable (\S+?)((?:\.[A-Za-z_\[\]0-9]+)*): (.*)$", re.S)


def merge_variable_problems(problems: list[str]) -> list[str]:
    """One sentence per distinct problem: ``variable a.x: P`` and ``variable b.x: P`` become
    ``variables a, b: x: P`` (a bad value repeated over many variables is said once)."""
    groups: dict[tuple[str, str], list[str]] = {}
    order: list = []
    for p in problems:
        m = _PER_VARIABLE.match(p)
        if not m:
            order.append(p)
            continue
        key = (m.group(2), m.group(3))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(m.group(1))
    out = []
    for item in order:
        if isinstance(item, str):
            out.append(item)
            continue
        names = groups[item]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        if len(names) == 1:
            out.append(f"variable {shown}{item[0]}: {item[1]}")
        else:
            out.append(f"variables {shown}: {item[0][1:] + ': ' if item[0] else ''}{item[1]}")
    return out


@dataclass(frozen=True)
class VarConfig:
    """How one variable is synchronized.

    Attributes:
        name: the variable's name in the ModelSpec.
        synchronizers: one per shard; a single entry means the variable is not partitioned.
        axis: the axis the variable is split along when partitioned. Shards are contiguous and
            as even as possible (the first ``dim % shards`` shards get one more slice).
    """

    name: str
    synchronizers: tuple[Synchronizer, ...]
    axis: int = 0

    def __post_init__(self):
        object.__setattr__(self, "synchronizers", tuple(self.synchronizers))
        problems = []
        if not self.synchronizers:
            problems.append(f"variable {self.name}: needs at least one synchronizer")
        if not all(isinstance(s, (PS, AllReduce)) for s in self.synchronizers):
            problems.append(f"variable {self.name}: synchronizers must be PS or AllReduce")
        if not isinstance(self.axis, int) or self.axis < 0:
            problems.append(f"variable {self.name}: partition axis must be an integer >= 0, got "
                            f"{short_repr(self.axis)}")
        if problems:
            raise ConfigError(problems)

    @property
    def num_shards(self) -> int:
        return len(self.synchronizers)

    @property
    def partitioned(self) -> bool:
        return len(self.synchronizers) > 1

    @property
    def uniform(self) -> bool:
        """All shards use the same kind of synchronizer with the same options (PS destinations and
        AR groups aside)."""
        first = self.synchronizers[0]
        if isinstance(first, PS):
            return all(isinstance(s, PS) and (s.local_replication, s.sync, s.staleness)
                       == (first.local_replication, first.sync, first.staleness) for s in self.synchronizers)
        return all(isinstance(s, AllReduce) and (s.backend, s.compressor, s.hierarchical)
                   == (first.backend, first.compressor, first.hierarchical) for s in self.synchronizers)

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"var": self.name}
        if self.partitioned:
            d["partition"] = {"axis": self.axis, "shards": self.num_shards}
            if all(s == self.synchronizers[0] for s in self.synchronizers):
                d.update(self.synchronizers[0].to_dict())
            else:
                d["shards"] = [s.to_dict() for s in self.synchronizers]
        else:
            d.update(self.synchronizers[0].to_dict())
        return d

    @classmethod
    def from_dict(cls, data: Mapping, where: str) -> "VarConfig":
        check_keys(data, where, {"var"}, {"partition", "ps", "all_reduce", "shards", *_PER_SHARD})
        name = get_typed(data, "var", str, where)
        where = f"variable {name}"
        axis, shards = 0, 1
        if "partition" in data:
            part = check_keys(data["partition"], f"{where}.partition", {"shards"}, {"axis"})
            axis = get_typed(part, "axis", int, f"{where}.partition", 0)
            shards = get_typed(part, "shards", int, f"{where}.partition")
            if not 1 <= shards <= MAX_SHARDS:
                raise ConfigError(f"{where}.partition.shards must be from 1 to {MAX_SHARDS}, got {short_repr(shards)}")
        if _PER_SHARD.keys() & data.keys():
            syncs = _per_shard_syncs(data, shards, where)
        elif "shards" in data:
            if "ps" in data or "all_reduce" in data:
                raise ConfigError(f"{where}: give either one synchronizer ('ps'/'all_reduce') for all shards or a 'shards' list, not both")
            items = get_typed(data, "shards", list, where)
            if len(items) != shards:
                raise ConfigError(f"{where}: partition.shards is {shards} but the shards list has {len(items)} entries")
            syncs = tuple(_sync_from_dict(check_keys(it, f"{where}.shards[{i}]", set(), {"ps", "all_reduce"}),
                                          f"{where}.shards[{i}]") for i, it in enumerate(items))
        else:
            syncs = (_sync_from_dict(data, where),) * shards
        return cls(name=name, synchronizers=syncs, axis=axis)


# The compact form of a partitioned variable whose shards share one synchronizer's options and differ
# only in where each lives: one ``ps:`` without its destination plus ``destinations: [...]``, or one
# ``all_reduce:`` without its group plus ``groups: [...]`` (what the YAML writer uses past a few shards:
# a list of names is ~10x shorter than a list of synchronizers).
_PER_SHARD = {"destinations": ("ps", "destination", str), "groups": ("all_reduce", "group", int)}


def _per_shard_syncs(data: Mapping, shards: int, where: str) -> tuple[Synchronizer, ...]:
    """The shards' synchronizers of a variable in the compact form (see ``_PER_SHARD``)."""
    given = sorted(_PER_SHARD.keys() & data.keys())
    key = given[0]
    kind, field_name, typ = _PER_SHARD[key]
    others = sorted({"shards", "ps", "all_reduce", *_PER_SHARD} & data.keys() - {key, kind})
    if len(given) > 1 or others or kind not in data:
        raise ConfigError(f"{where}: '{key}' goes with one '{kind}:' entry (its options, no {field_name}) "
                          f"and nothing else" + (f"; remove {', '.join(others)}" if others else ""))
    body = data[kind] if data[kind] is not None else {}
    if not isinstance(body, Mapping):
        raise ConfigError(f"{where}.{kind}: expected a mapping of options, got {short_repr(body)}")
    if field_name in body:
        raise ConfigError(f"{where}: give each shard's {field_name} in '{key}' or one {kind}.{field_name} for all "
                          f"shards, not both")
    # the keys this form allows there: the synchronizer's options less the one given per shard
    check_keys(body, f"{where}.{kind}", set(),
               {f.name for f in dataclasses.fields(PS if kind == "ps" else AllReduce)} - {field_name})
    items = get_typed(data, key, list, where)
    if len(items) != shards:
        raise ConfigError(f"{where}: partition.shards is {shards} but '{key}' has {len(items)} entries")
    # the options checked once, with a stand-in for the per-shard field; then each shard's value
    template = (PS if kind == "ps" else AllReduce).from_dict({**body, field_name: typ("x" if typ is str else 0)}, where)
    syncs: dict = {}
    problems: list[str] = []
    for i, value in enumerate(items):
        try:   # typed before it is looked up (True == 1 as a key)
            if not isinstance(value, typ) or isinstance(value, bool):
                raise ConfigError(f"expected {'a node name' if typ is str else 'an integer'}, got {short_repr(value)}")
            if value not in syncs:
                syncs[value] = dataclasses.replace(template, **{field_name: value})
        except ConfigError as e:
            problems.extend(p if p.startswith(where) else f"{where}.{key}[{i}]: {p}" for p in e.problems)
            if len(problems) >= MAX_PROBLEMS_KEPT:   # as ``parse_items`` stops
                problems.append(f"{where}.{key}: stopped reading at item {i + 1} of {len(items)} after "
                                f"{len(problems)} problems; fix these first")
                break
    if problems:
        raise ConfigError(problems)
    return tuple(syncs[v] for v in items)


@dataclass(frozen=True)
class Strategy:
    """A complete synchronization strategy.

    Attributes:
        variables: one VarConfig per trainable variable.
        replicas: the worker slots (``node:i``) that train; empty means every slot of the cluster.
        origin: where it came from (a builder name, ``tuned``); informative only, so it takes no
            part in equality or the fingerprint.
    """

    variables: tuple[VarConfig, ...]
    replicas: tuple[str, ...] = ()
    origin: str = field(default="", compare=False)
    _by_name: dict = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]
    # the fingerprint, computed on first read (it serializes the whole strategy); not in eq/hash/repr
    _fingerprint: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "variables", tuple(self.variables))
        object.__setattr__(self, "replicas", tuple(self.replicas))
        object.__setattr__(self, "_by_name", {c.name: c for c in self.variables})

    def config(self, name: str) -> VarConfig:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"strategy has no config for variable {short_repr(name)}") from None

    def resolved_replicas(self, cluster) -> tuple[str, ...]:
        return self.replicas or cluster.devices

    def ps_nodes(self) -> tuple[str, ...]:
        """The nodes that host a parameter-server shard of some variable, sorted (none for a
        strategy that all-reduces everything)."""
        return tuple(sorted({s.destination for c in self.variables for s in c.synchronizers if isinstance(s, PS)}))

    @property
    def fingerprint(self) -> str:
        """Content hash of the strategy (``origin`` left out); computed once per object."""
        if self._fingerprint is None:
            d = self.to_dict()
            d.pop("origin", None)
            object.__setattr__(self, "_fingerprint", fingerprint(d))
        return self._fingerprint

    def canonical(self, cluster=None) -> "Strategy":
        """The canonical equivalent: one representative of the strategies that run identically;
        idempotent. Two strategies are the same run when they differ only in
          * how fusion groups are numbered: a group is a set of variables (shards) reduced together and
            the runtime issues groups in gradient-ready order, so ids carry no meaning beyond which
            shards share a group; the canonical form numbers groups 0, 1, ... in first-use order
            (variables by name, shards in order);
          * which of several identical nodes holds what (with a cluster given): when every node of the
            cluster is alike (workers, CPUs, GPUs, bandwidths), a placement and its rotation over the
            nodes are the same run; the canonical form rotates node names so that the first parameter
            server shard (variables by name) sits on the first node. A rotation keeps round-robin shard
            placement round-robin, so a canonical strategy stays in the tuner's encoded space;
          * the order the variables are listed in, and the ``origin`` label.
        """
        configs = sorted(self.variables, key=lambda c: c.name)
        rename: dict[str, str] = {}
        if cluster is not None and len(cluster.nodes) > 1 and not self.replicas and _identical_nodes(cluster):
            names = list(cluster.node_names)
            first = next((s.destination for c in configs for s in c.synchronizers if isinstance(s, PS)), None)
            if first in names:
                shift = names.index(first)
                rename = {n: names[(i - shift) % len(names)] for i, n in enumerate(names)}
        groups: dict[int, int] = {}
        out = []
        for c in configs:
            syncs = []
            for s in c.synchronizers:
                if isinstance(s, AllReduce):
                    s = dataclasses.replace(s, group=groups.setdefault(s.group, len(groups)))
                elif rename:
                    s = dataclasses.replace(s, destination=rename.get(s.destination, s.destination))
                syncs.append(s)
            out.append(VarConfig(c.name, tuple(syncs), c.axis))
        return Strategy(tuple(out), self.replicas)

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"kind": "strategy", "version": FORMAT_VERSION}
        if self.origin:
            d["origin"] = self.origin
        if self.replicas:
            d["replicas"] = list(self.replicas)
        d["variables"] = [c.to_dict() for c in self.variables]
        return d

    @classmethod
    def from_dict(cls, data: Mapping) -> "Strategy":
        check_keys(data, "strategy", {"variables"}, {"kind", "version", "replicas", "origin"})
        check_header(data, "strategy")
        replicas = get_typed(data, "replicas", list, "strategy", [])
        if not all(isinstance(r, str) for r in replicas):
            raise ConfigError(f"strategy.replicas: expected a list of 'node:slot' strings, got {short_repr(replicas)}")
        try:
            configs = parse_items(get_typed(data, "variables", list, "strategy"), VarConfig.from_dict, "variables")
        except ConfigError as e:
            raise ConfigError(merge_variable_problems(e.problems)) from None
        return cls(variables=tuple(configs), replicas=tuple(replicas),
                   origin=get_typed(data, "origin", str, "strategy", ""))


def shard_bounds(dim: int, shards: int) -> list[tuple[int, int]]:
    """[start, stop) of each shard when ``dim`` slices are split into ``shards`` contiguous parts,
    the first ``dim % shards`` parts one longer (numpy.array_split's rule)."""
    base, extra = divmod(dim, shards)
    bounds, start = [], 0
    for i in range(shards):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _identical_nodes(cluster) -> bool:
    facts = {(n.workers, n.cpus, n.gpus, n.bandwidth_gbps)
             for n in cluster.nodes}
    return len(facts) == 1
