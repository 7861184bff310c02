"""Pinning: the parts of a strategy the user fixes; the search never violates them.

A constraints file::

    kind: constraints
    version: 1
    staleness: 0                 # optional, strategy-wide (parameter servers)
    variables:                   # rules apply in order; a later rule overrides an earlier one
    - match: "embedding*"        # glob on variable names
      sync: ps                   # ps | all_reduce
      shards: 2
      destination: host0         # first shard's node (shards go round-robin from it)
    - sparse: false              # select by gradient kind instead of (or with) a name
      compressor: none

Constraints are compiled against a StrategySpace into per-variable masks and values, then
``apply`` projects any batch of encoded strategies onto them (a few array writes), which is why
every candidate the search scores already satisfies them.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field

import numpy as np

from strategy_space.errors import listed_names, short_repr
from strategy_space.strict import check_keys, get_typed
from strategy_space.errors import ConfigError, Problems
from strategy_space.encoding import BACKEND_ID, COMPRESSOR_ID, KIND_AR, KIND_PS, EncodedStrategies
from strategy_space.space import StrategySpace
from strategy_space.cluster_spec import ClusterSpec
from strategy_space.compressor import Compressor
from strategy_space.strategy import BACKENDS, MAX_GROUP, MAX_SHARDS, MAX_STALENESS
from strategy_space.yaml_io import parse_text, read_text

_SYNC = {"ps": KIND_PS, "all_reduce": KIND_AR}
_PS_ONLY = ("destination", "local_replication")
_AR_ONLY = ("compressor", "group", "backend")


@dataclass(frozen=True)
class Rule:
    """What one rule fixes for the variables it selects (None: not fixed)."""

    match: str = "*"
    sparse: bool | None = None
    sync: str | None = None
    shards: int | None = None
    destination: str | None = None
    local_replication: bool | None = None
    compressor: str | None = None
    group: int | None = None
    backend: str | None = None

    def __post_init__(self):
        p = Problems()
        where = f"constraint rule match={short_repr(self.match)}"
        if self.sync is not None and self.sync not in _SYNC:
            p.add(f"{where}: sync {short_repr(self.sync)} is not one of ps, all_reduce")
        ps_opts = [k for k in _PS_ONLY if getattr(self, k) is not None]
        ar_opts = [k for k in _AR_ONLY if getattr(self, k) is not None]
        if ps_opts and ar_opts:
            p.add(f"{where}: fixes PS options ({', '.join(ps_opts)}) and all-reduce options ({', '.join(ar_opts)}) "
                  f"together; a variable is one or the other")
        if self.sync == "ps" and ar_opts or self.sync == "all_reduce" and ps_opts:
            p.add(f"{where}: sync {self.sync} conflicts with {', '.join(ar_opts or ps_opts)}")
        if self.shards is not None and not 1 <= self.shards <= MAX_SHARDS:
            p.add(f"{where}: shards must be from 1 to {MAX_SHARDS}, got {short_repr(self.shards)}")
        if self.compressor is not None:
            try:
                Compressor.parse(self.compressor)
            except ConfigError as e:
                p.items.extend(f"{where}: {x}" for x in e.problems)
        if self.backend is not None and self.backend not in BACKENDS:
            p.add(f"{where}: backend {short_repr(self.backend)} is not one of {', '.join(BACKENDS)}")
        if self.group is not None and not 0 <= self.group <= MAX_GROUP:
            p.add(f"{where}: group must be from 0 to {MAX_GROUP}, got {short_repr(self.group)}")
        p.raise_if_any()

    @property
    def label(self) -> str:
        """How messages name this rule."""
        return (f"constraint rule match={short_repr(self.match)}"
                + (f" sparse={self.sparse}" if self.sparse is not None else ""))

    @property
    def kind(self) -> int | None:
        """The synchronizer kind this rule implies, if any."""
        if self.sync is not None:
            return _SYNC[self.sync]
        if any(getattr(self, k) is not None for k in _PS_ONLY):
            return KIND_PS
        if any(getattr(self, k) is not None for k in _AR_ONLY):
            return KIND_AR
        return None

    def selects(self, name: str, sparse: bool) -> bool:
        return fnmatch.fnmatchcase(name, self.match) and (self.sparse is None or self.sparse == sparse)


@dataclass(frozen=True)
class Constraints:
    """Rules per variable plus the strategy-wide PS staleness."""

    rules: tuple[Rule, ...] = ()
    staleness: int | None = None

    @classmethod
    def from_dict(cls, data) -> "Constraints":
        check_keys(data, "constraints", set(), {"kind", "version", "staleness", "variables"})
        if data.get("kind", "constraints") != "constraints":
            raise ConfigError(f"expected a constraints file (kind: constraints), got kind: {short_repr(data['kind'])}")
        if data.get("version", 1) != 1:
            raise ConfigError(f"constraints format version {short_repr(data['version'])} is not supported; this "
                              f"AutoSync reads 1")
        keys = {f for f in Rule.__dataclass_fields__}
        problems: list[str] = []
        rules = []
        for i, item in enumerate(get_typed(data, "variables", list, "constraints", [])):
            where = f"constraints.variables[{i}]"
            try:
                check_keys(item, where, set(), keys)
                types = {"match": str, "sparse": bool, "sync": str, "shards": int, "destination": str,
                         "local_replication": bool, "compressor": str, "group": int, "backend": str}
                rules.append(Rule(**{k: get_typed(item, k, types[k], where) for k in item}))
            except ConfigError as e:
                problems.extend(e.problems)
        if problems:
            raise ConfigError(problems)
        staleness = get_typed(data, "staleness", (int, type(None)), "constraints", None)
        if staleness is not None and not 0 <= staleness <= MAX_STALENESS:
            raise ConfigError(f"constraints.staleness must be from 0 to {MAX_STALENESS}, got {short_repr(staleness)}")
        return cls(tuple(rules), staleness)

    def to_dict(self) -> dict:
        out: dict = {"kind": "constraints", "version": 1}
        if self.staleness is not None:
            out["staleness"] = self.staleness
        out["variables"] = [{k: v for k, v in r.__dict__.items() if v is not None and not (k == "match" and v == "*")}
                            for r in self.rules]
        return out

    def lossy_pins(self) -> list[str]:
        """The pins that fix a lossy part (a compressor, staleness > 0), said as in the file."""
        out = [f"{r.label}: compressor {r.compressor}" for r in self.rules
               if r.compressor is not None and Compressor.parse(r.compressor).kind != "none"]
        if self.staleness:
            out.append(f"staleness {self.staleness}")
        return out

    def compile(self, space: StrategySpace) -> "CompiledConstraints":
        """Masks and values per variable for ``space``.

        Raises:
            ConfigError: a rule that selects no variable, a destination not in the cluster, or
                more shards than a selected variable allows.
        """
        model, cluster = space.model, space.cluster
        V = len(model.variables)
        fields_ = ("kind", "shards", "dest", "local_replication", "compressor", "rank", "group", "backend")
        c = CompiledConstraints({f: np.zeros(V, bool) for f in fields_}, {f: np.zeros(V, np.int32) for f in fields_},
                                self.staleness)
        p = Problems()
        for rule in self.rules:
            sel = np.array([rule.selects(v.name, v.sparse) for v in model.variables])
            where = rule.label
            if not sel.any():
                p.add(f"{where}: selects no variable of model {model.name}; check the pattern (e.g. "
                      f"{short_repr(model.names[0])})")
                continue
            if rule.kind is not None:
                c.set("kind", sel, rule.kind)
            if rule.shards is not None:
                too_many = [model.variables[i].name for i in np.nonzero(sel & (space.shard_max < rule.shards))[0]]
                if too_many:
                    p.add(f"{where}: shards {rule.shards} exceeds what {', '.join(too_many[:3])} allow "
                          f"(at most {int(space.shard_max[sel].min())} here)")
                c.set("shards", sel, rule.shards)
            if rule.destination is not None and rule.destination in cluster.node_names:
                c.set("dest", sel, cluster.node_index(rule.destination))
            if rule.local_replication is not None:
                c.set("local_replication", sel, int(rule.local_replication))
            if rule.compressor is not None:
                codec = Compressor.parse(rule.compressor)
                kind, rank = codec.name, codec.rank
                illegal = [model.variables[i].name for i in np.nonzero(sel & ~space.compressible)[0]]
                if kind != "none" and illegal:
                    p.add(f"{where}: compressor {rule.compressor} cannot apply to {', '.join(illegal[:3])} "
                          f"(sparse or not float); narrow the rule, e.g. with sparse: false")
                c.set("compressor", sel, COMPRESSOR_ID[kind])
                c.set("rank", sel, rank)
            if rule.group is not None:
                c.set("group", sel, rule.group)
            if rule.backend is not None:
                c.set("backend", sel, BACKEND_ID[rule.backend])
        p.items.extend(self.cluster_problems(cluster))
        p.raise_if_any()
        return c

    def cluster_problems(self, cluster: ClusterSpec) -> list[str]:
        """What the rules pin that ``cluster`` cannot run: a destination that is not one of its
        nodes, the nccl backend on nodes without GPUs. Needs no model, so ``tune`` checks it
        before any worker starts."""
        out = []
        no_gpu = [n.name for n in cluster.nodes if n.gpus == 0]
        for rule in self.rules:
            where = rule.label
            if rule.destination is not None and rule.destination not in cluster.node_names:
                out.append(f"{where}: destination {short_repr(rule.destination)} is not a node of cluster "
                           f"{cluster.name}; allowed: {listed_names(cluster.node_names)}")
            if rule.backend == "nccl" and no_gpu:
                out.append(f"{where}: backend nccl needs GPUs but node(s) {', '.join(no_gpu[:5])} of cluster "
                           f"{cluster.name} have none; pin backend gloo, objectstore or auto, or leave it free")
        return out


@dataclass
class CompiledConstraints:
    """Per-field masks (V,) of fixed variables and their values (V,)."""

    mask: dict = field(default_factory=dict)
    value: dict = field(default_factory=dict)
    staleness: int | None = None

    def set(self, name: str, sel: np.ndarray, value: int) -> None:
        self.mask[name] |= sel
        self.value[name][sel] = value

    def apply(self, e: EncodedStrategies, space: StrategySpace) -> EncodedStrategies:
        """Project ``e`` (in place) onto the constraints and return it normalized.

        A strategy has one PS mode (sync, staleness) for all its parameter servers. Variables a
        rule turns into parameter servers take the mode the strategy's other parameter servers
        already have, or, where it had none (an all-reduce strategy), the documented default:
        synchronous, staleness 0. ``staleness:`` in the file overrides both.
        """
        was_ps = e.kind == KIND_PS
        for name, mask in self.mask.items():
            if mask.any():
                arr = getattr(e, name)
                arr[:, mask] = self.value[name][mask]
        e.hierarchical[:, self.in_graph] = 0   # a hierarchical all-reduce stages outside the graph
        if self.staleness is not None:
            e.sync[:] = 1
            e.staleness[:] = self.staleness
        else:
            ps = e.kind == KIND_PS
            kept = was_ps & ps
            has = kept.any(axis=1)
            first = kept.argmax(axis=1)
            rows = np.arange(len(e))
            sync = np.where(has, e.sync[rows, first], 1)
            staleness = np.where(has, e.staleness[rows, first], 0)
            e.sync[:] = np.where(ps, sync[:, None], e.sync)
            e.staleness[:] = np.where(ps, staleness[:, None], e.staleness)
        return space.normalize(e)

    def changes(self, e: EncodedStrategies, space: StrategySpace) -> np.ndarray:
        """Per strategy, whether projecting it onto the constraints changes it (``e`` is kept)."""
        before = space.normalize(e.copy()).row_keys()
        after = self.apply(e.copy(), space).row_keys()
        return np.array([a != b for a, b in zip(after, before)], bool)

    def violations(self, e: EncodedStrategies) -> np.ndarray:
        """Per strategy, whether any fixed field differs (for checks and tests)."""
        bad = np.zeros(len(e), bool)
        ps = e.kind == KIND_PS
        applies = {"dest": ps, "local_replication": ps, "compressor": ~ps, "rank": ~ps, "group": ~ps, "backend": ~ps}
        for name, mask in self.mask.items():
            if mask.any():
                differs = (getattr(e, name) != self.value[name]) & mask
                bad |= (differs & applies.get(name, True)).any(axis=1)
        if self.staleness is not None:
            bad |= ((e.staleness != self.staleness) & ps).any(axis=1)
        bad |= ((e.hierarchical != 0) & ~ps & self.in_graph).any(axis=1)
        return bad

    @property
    def in_graph(self) -> np.ndarray:
        """Per variable, whether a rule pins its all-reduce to the graph backend: reduced inside
        the training step, so flat (a hierarchical all-reduce stages through the object store)."""
        return self.mask["backend"] & (self.value["backend"] == BACKEND_ID["graph"])


def load_constraints(path: str) -> Constraints:
    """Read a constraints YAML file.

    Raises:
        ConfigError: with the file name and every problem.
    """
    try:
        return Constraints.from_dict(parse_text(read_text(path), path) or {})
    except ConfigError as e:
        raise e.with_source(str(path)) from None


def as_constraints(value) -> Constraints | None:
    """Pinned decisions as the Python API takes them: a Constraints, a constraints YAML path (a
    str or a path), the YAML's content as a dict, or None (nothing pinned).

    Raises:
        ConfigError: a bad file or dict (every problem), or anything else.
    """
    if value is None or isinstance(value, Constraints):
        return value
    if isinstance(value, (str, os.PathLike)):
        return load_constraints(os.fspath(value))
    if isinstance(value, dict):
        return Constraints.from_dict(value)
    raise ConfigError(f"constraints must be a Constraints, a constraints YAML path or its content as a dict, "
                      f"got {type(value).__name__} {short_repr(value)}")
