"""YAML files for strategies, model specs and cluster specs.

Every file carries ``kind`` (strategy | model | cluster) and ``version``; readers are strict and
writers are atomic (temp file + ``os.replace``), so ``load(dump(x)) == x`` and no half-written file
is ever seen.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Union

import yaml

from ._yaml_limits import MAX_DEPTH, MAX_FILE_BYTES, FastLoader, PlainLoader, YAMLLimitError
from .cluster_spec import ClusterSpec
from .errors import ConfigError, short_repr
from .model_spec import ModelSpec
from .strategy import Strategy

KINDS = {"strategy": Strategy, "model": ModelSpec, "cluster": ClusterSpec}
Loaded = Union[Strategy, ModelSpec, ClusterSpec]


class _Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):
    """Block style for mappings, flow style for short lists of scalars (shapes). libyaml's emitter
    where PyYAML has it: 3.4x faster on strategies and specs, the same text on every builder's and
    750 sampled strategies (it words some exotic strings differently, e.g. a quoted string longer
    than a line is folded elsewhere; both read back the same)."""


def _represent_list(dumper, data):
    flow = len(data) <= 8 and all(isinstance(x, (int, float, str, bool)) and not isinstance(x, str) or
                                  isinstance(x, str) and len(x) < 24 for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


def _represent_dict(dumper, data):
    # small mappings of scalars (a synchronizer's options, a partition) read best on one line
    flow = 0 < len(data) <= 4 and all(isinstance(v, (int, float, str, bool)) for v in data.values()) \
        and not {"kind", "name", "var"} & set(data)
    return dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=flow)


class _Inline(list):
    """A list written on (wrapped) lines of its own, whatever its length: a shard's node names."""


_Dumper.add_representer(list, _represent_list)
_Dumper.add_representer(dict, _represent_dict)
_Dumper.add_representer(_Inline, lambda dumper, data: dumper.represent_sequence(
    "tag:yaml.org,2002:seq", data, flow_style=True))

# Past this many shards, a variable whose shards differ only in destination (or fusion group) is
# written in the compact form (``strategy._PER_SHARD``): a 512-shard list of synchronizers is 40 KB
# a variable, enough to put a plan for a few hundred nodes past the size every reader accepts.
COMPACT_SHARDS = 8


def _compact(var: dict) -> dict:
    """A variable's dict with its shard list in the compact form, where it has one."""
    shards = var.get("shards")
    if not shards or len(shards) <= COMPACT_SHARDS or len({next(iter(s)) for s in shards}) != 1:
        return var
    kind = next(iter(shards[0]))
    key, per_shard = ("destinations", "destination") if kind == "ps" else ("groups", "group")
    options = [{k: v for k, v in s[kind].items() if k != per_shard} for s in shards]
    if any(o != options[0] for o in options):
        return var
    out = {k: v for k, v in var.items() if k != "shards"}
    out[kind], out[key] = options[0], _Inline(s[kind][per_shard] for s in shards)
    return out


def dumps(obj: Loaded) -> str:
    """YAML text of a Strategy, ModelSpec or ClusterSpec."""
    d = obj.to_dict()
    if isinstance(obj, Strategy):
        d["variables"] = [_compact(v) for v in d["variables"]]
    return yaml.dump(d, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def parse_text(text: str, source: str = "<string>") -> Any:
    """The plain data of YAML ``text``, through the bounded loaders (``_yaml_limits``).

    Raises:
        ConfigError: bad YAML, or a document past the limits (an alias bomb, a recursive alias,
            too deep nesting), with ``source`` and where.
    """
    try:
        return yaml.load(text, Loader=FastLoader)
    except YAMLLimitError as e:
        raise ConfigError(f"refused to load: {e}", source=source) from None
    except yaml.YAMLError:
        pass
    try:  # bad YAML: the pure-Python loader words the problem better
        return yaml.load(text, Loader=PlainLoader)
    except YAMLLimitError as e:
        raise ConfigError(f"refused to load: {e}", source=source) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"not valid YAML{where}: {problem}", source=source) from None
    except RecursionError:
        raise ConfigError(f"refused to load: nesting deeper than {MAX_DEPTH} levels", source=source) from None


def read_text(path: str | os.PathLike) -> str:
    if not os.fspath(path).strip():   # Path("") is "." (the current folder), not what was meant
        raise ConfigError("the file path is empty; give the path of a YAML file")
    p = Path(path).expanduser()   # (the Python API is given "~/x.yaml" unexpanded by any shell)
    try:   # (is_dir raises, not answers False, for a name too long or a loop of links)
        if p.is_dir():
            raise ConfigError(f"{p} is a directory; give the path of a YAML file")
        if not p.is_file():
            if p.exists():   # a device, a pipe, a socket: nothing a file of bounded size can be read from
                raise ConfigError(f"{p} is not a regular file; give the path of a YAML file")
            raise ConfigError(f"file not found: {p} (give the path of an existing YAML file)")
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigError(f"{p} is {size / 2**20:.1f} MiB, more than the {MAX_FILE_BYTES // 2**20} MiB a "
                              f"strategy, spec or constraints file may have; is it the right file?")
        return p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read {p}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"cannot read {p}: {e}") from None


def loads(text: str, expect: str | None = None, source: str = "<string>") -> Loaded:
    """Parse YAML text into the object its ``kind`` names (or ``expect`` when kind is absent).

    Raises:
        ConfigError: bad YAML, an unknown or unexpected kind, or invalid content.
    """
    data = parse_text(text, source)
    if not isinstance(data, dict):
        raise ConfigError(f"expected a YAML mapping with 'kind: {expect or 'strategy|model|cluster'}', "
                          f"got {type(data).__name__}", source=source)
    kind = data.get("kind", expect)
    if not isinstance(kind, str) or kind not in KINDS:
        raise ConfigError(f"unknown or missing 'kind': {short_repr(kind)}; allowed: {', '.join(KINDS)}", source=source)
    if expect is not None and kind != expect:
        raise ConfigError(f"expected a {expect} file but this is a {kind} file (kind: {kind})", source=source)
    try:
        return KINDS[kind].from_dict(data)
    except ConfigError as e:
        raise e.with_source(source) from None


def load(path: str | os.PathLike, expect: str | None = None) -> Loaded:
    return loads(read_text(path), expect=expect, source=str(path))


def load_strategy(path: str | os.PathLike) -> Strategy:
    return load(path, "strategy")  # type: ignore[return-value]


def load_model_spec(path: str | os.PathLike) -> ModelSpec:
    return load(path, "model")  # type: ignore[return-value]


def load_cluster_spec(path: str | os.PathLike) -> ClusterSpec:
    return load(path, "cluster")  # type: ignore[return-value]


def nearest_existing(path: str | os.PathLike) -> str:
    """The path itself (absolute), or the closest ancestor of it that exists: where a file or
    folder to be made at ``path`` would go."""
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder and ``os.replace``."""
    p = Path(path).expanduser()   # (the Python API is given "~/x.yaml" unexpanded by any shell)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save(obj: Loaded, path: str | os.PathLike) -> None:
    atomic_write_text(path, dumps(obj))
