"""ModelSpec: the plain data the tuner needs about a model (its variables, batch size and measured
compute profile).

A frozen dataclass that validates itself on construction, reads and writes plain mappings
(``from_dict``/``to_dict``, strict about unknown keys) and has a stable ``fingerprint``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ConfigError, short_repr
from .strict import check_header, check_keys, fingerprint, get_typed, parse_items

DTYPE_BYTES = {
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
# the largest dimension a variable may have: shard, row and group counts are encoded in int32
MAX_DIMENSION = 2 ** 31 - 1
# an optimizer keeping more full-size arrays per variable than this is not one Keras ships (Adam with
# amsgrad and an EMA keeps 4)
MAX_SLOTS = 16


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
        elif any(d > MAX_DIMENSION for d in self.shape):
            problems.append(f"variable {self.name}: a dimension of shape {list(self.shape)} is over {MAX_DIMENSION:,} "
                            f"(2^31 - 1), the most any dimension may have here (strategies and their features "
                            f"count shards and rows in 32 bits); a table that long is usually hashed into fewer rows")
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
        global_clipnorm: the model's optimizer clips a step's gradients by the norm of all of them
            (Keras ``global_clipnorm``): a step carried outside the graph (a synchronous PS, the
            numpy all-reduce) is held until every shard agrees on the scale, which costs a round
            trip and the overlap of its pushes with its pulls. Dynamic loss scaling (a
            ``LossScaleOptimizer``, a ``mixed_float16`` model) holds its steps alike: true then too. Part of the fingerprint (and
            written) only when true, so other specs keep theirs.
        optimizer_slots: arrays of a variable's full size the model's optimizer keeps per variable
            (Adam 2, SGD with momentum 1, Adagrad 1): what a parameter server holds per shard, and
            a worker per all-reduced variable, besides the values (``strategy_space.memory``; 0:
            none or not known). Written only when > 0; not part of the fingerprint (a step moves
            the same bytes whatever the optimizer keeps).
    """

    name: str
    variables: tuple[VariableSpec, ...]
    batch_size: int = 32
    profile: ComputeProfile | None = None
    global_clipnorm: bool = False
    optimizer_slots: int = 0

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
        if not isinstance(self.global_clipnorm, bool):
            problems.append(f"model {self.name}: global_clipnorm must be true or false, got "
                            f"{short_repr(self.global_clipnorm)}")
        if not (isinstance(self.optimizer_slots, int) and not isinstance(self.optimizer_slots, bool)
                and 0 <= self.optimizer_slots <= MAX_SLOTS):
            problems.append(f"model {self.name}: optimizer_slots must be an integer from 0 to {MAX_SLOTS} (arrays "
                            f"of a variable's size the optimizer keeps per variable), got "
                            f"{short_repr(self.optimizer_slots)}")
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

    @functools.cached_property   # the spec is frozen: hashed once per object
    def fingerprint(self) -> str:
        """Hash of what determines communication: variables, batch size and global clipping (only
        when set), not the profile."""
        body: dict[str, Any] = {"variables": [v.to_dict() for v in self.variables], "batch_size": self.batch_size}
        if self.global_clipnorm:
            body["global_clipnorm"] = True
        return fingerprint(body)

    def to_dict(self) -> dict:
        d: dict[str, Any] = {
            "kind": "model",
            "version": 1,
            "name": self.name,
            "batch_size": self.batch_size,
            "variables": [v.to_dict() for v in self.variables],
        }
        if self.global_clipnorm:
            d["global_clipnorm"] = True
        if self.optimizer_slots:
            d["optimizer_slots"] = self.optimizer_slots
        if self.profile is not None:
            d["profile"] = self.profile.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: Mapping) -> "ModelSpec":
        check_keys(data, "model", {"name", "variables"},
                   {"kind", "version", "batch_size", "profile", "global_clipnorm", "optimizer_slots"})
        check_header(data, "model")
        variables = parse_items(get_typed(data, "variables", list, "model"), VariableSpec.from_dict, "variables")
        profile = data.get("profile")
        return cls(
            name=get_typed(data, "name", str, "model"),
            variables=tuple(variables),
            batch_size=get_typed(data, "batch_size", int, "model", 32),
            profile=ComputeProfile.from_dict(profile) if profile is not None else None,
            global_clipnorm=get_typed(data, "global_clipnorm", bool, "model", False),
            optimizer_slots=get_typed(data, "optimizer_slots", int, "model", 0),
        )
