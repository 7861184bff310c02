"""Strict reading of plain YAML/JSON mappings: unknown keys, wrong types and another file kind or
format version are errors that say where they are and what is allowed."""
from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from .errors import ConfigError, short_repr

_MISSING = object()


def check_keys(data: Any, where: str, required: set[str], optional: set[str] = frozenset()) -> Mapping:
    """Return ``data`` if it is a mapping whose keys are exactly ``required`` plus some of
    ``optional``; raise ConfigError naming every unknown or missing key otherwise."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__} {short_repr(data)}")
    problems = []
    allowed = set(required) | set(optional)
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        problems.append(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed keys are {', '.join(sorted(allowed))}"
        )
    missing = sorted(k for k in required if k not in data)
    if missing:
        problems.append(f"{where}: missing required key(s) {', '.join(missing)}")
    if problems:
        raise ConfigError(problems)
    return data


def get_typed(data: Mapping, key: str, types: type | tuple, where: str, default: Any = _MISSING) -> Any:
    """``data[key]`` checked against ``types`` (bool is never accepted as a number)."""
    if key not in data:
        if default is _MISSING:
            raise ConfigError(f"{where}: missing required key {key}")
        return default
    value = data[key]
    types_t = types if isinstance(types, tuple) else (types,)
    is_bool = isinstance(value, bool)
    ok = isinstance(value, types_t) and not (is_bool and bool not in types_t)
    if not ok:
        names = " or ".join(t.__name__ for t in types_t)
        raise ConfigError(f"{where}.{key}: expected {names}, got {type(value).__name__} {short_repr(value)}")
    return value


def fingerprint(obj: Any) -> str:
    """A stable 16-hex-digit hash of a JSON-able object (key order does not matter)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# a list with more bad items than this stops being read: a file of a million bad entries costs
# the time and memory of its first ones, not a million messages
MAX_PROBLEMS_KEPT = 200


def parse_items(items, parse, where: str) -> list:
    """``parse(item, where=f"{where}[i]")`` for every item; the problems of all items (of the
    first ones, past ``MAX_PROBLEMS_KEPT``) are raised together as one ConfigError."""
    problems: list[str] = []
    out = []
    for i, item in enumerate(items):
        if len(problems) >= MAX_PROBLEMS_KEPT:
            problems.append(f"{where}: stopped reading at item {i} of {len(items)} after {len(problems)} problems; "
                            f"fix these first")
            break
        try:
            out.append(parse(item, where=f"{where}[{i}]"))
        except ConfigError as e:
            problems.extend(e.problems)
    if problems:
        raise ConfigError(problems)
    return out


FORMAT_VERSION = 1


def check_header(data: Mapping, kind: str) -> None:
    """The ``kind`` and ``version`` of a spec or strategy file, when given, are ``kind`` and
    ``FORMAT_VERSION``."""
    if "kind" in data and data["kind"] != kind:
        raise ConfigError(f"expected a {kind} file (kind: {kind}), got kind: {short_repr(data['kind'])}")
    version = data.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise ConfigError(f"{kind} format version {short_repr(version)} is not supported; this AutoSync reads "
                          f"version {FORMAT_VERSION}")
