"""Bounded YAML loading: every file AutoSync reads (strategy, model spec, cluster, constraints)
goes through these loaders, which refuse input that would expand far beyond its own size and keep
the memory a file costs a small multiple of its size.

PyYAML's own loaders first compose the whole document as a graph of node objects (each with two
position marks: about 200 bytes of memory per byte of a dense file, so a 10 MB list takes 2 GB and
half a minute), then build Python values from it. These loaders build the values straight from
the parser's event stream instead: each event is read, turned into its value and dropped, so what
a document costs is its values (measured: at most ``MAX_BYTES_PER_INPUT_BYTE`` bytes per byte of
the file, see tests/test_yaml_limits.py) plus the file's text.

A YAML alias (``*name``) refers to an anchored value (``&name``); a few kilobytes of nested
anchors stand for a document of billions of nodes (an "alias bomb"). Values are shared, as PyYAML
shares them, but everything that later walks the document (validation, fingerprints, an error
message's repr) walks the whole expansion; so every alias counts the nodes of what it refers to,
and the document is refused as soon as aliases add more than ``MAX_ALIAS_NODES``. A recursive
alias and nesting deeper than ``MAX_DEPTH`` are refused too.
"""
from __future__ import annotations

import re
import sys

import yaml
from yaml.events import (AliasEvent, DocumentEndEvent, MappingEndEvent, MappingStartEvent, ScalarEvent,
                         SequenceEndEvent, SequenceStartEvent, StreamEndEvent)
from yaml.nodes import ScalarNode

# Nodes that aliases may add on top of the written ones: far above any real spec (AutoSync's own
# files use no aliases; a 5,000-variable model sharing one anchored synchronizer adds ~25,000),
# and small enough that walking that many values stays a fraction of a second.
MAX_ALIAS_NODES = 100_000
# Nesting depth: AutoSync's formats nest about 6 deep.
MAX_DEPTH = 64
# Largest file read. The largest real file is well under 1 MiB (a strategy or model spec for
# thousands of variables; configs/ holds at most 40 KiB); at this size the worst case measured (a
# file of nothing but tiny flow mappings, about a million YAML events whose creation by the
# parser is most of the cost) loads and is refused in about 3 s on a loaded 2-core machine,
# within MAX_BYTES_PER_INPUT_BYTE times the size in memory (validation stops after its first
# problems: see strict.MAX_PROBLEMS_KEPT).
MAX_FILE_BYTES = 2 * 1024 * 1024
# The stated bound on the memory of loading, per byte of the file (values plus the text); the
# fuzz and limit tests measure it on the densest documents (see tests/test_yaml_limits.py).
MAX_BYTES_PER_INPUT_BYTE = 40

_SCALAR_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("null", "bool", "int", "float", "str", "binary", "timestamp")}
_SEQ_TAGS = {None, "!", "tag:yaml.org,2002:seq"}
_MAP_TAGS = {None, "!", "tag:yaml.org,2002:map"}
_MERGE_TAG = "tag:yaml.org,2002:merge"
_MISSING = object()
_SCALAR_CACHE = 4096   # distinct short scalars resolved once each
_MERGE = object()   # a plain ``<<`` scalar: a merge key in key position, the string "<<" elsewhere


class YAMLLimitError(yaml.YAMLError):
    """A document past the limits above; ``str`` says which and by how much."""


class _Container:
    """A sequence or mapping being built from its events."""

    __slots__ = ("value", "is_map", "key", "has_key", "anchor", "nodes", "merges", "mark")

    def __init__(self, is_map: bool, anchor: str | None, mark):
        self.value = {} if is_map else []
        self.is_map, self.anchor, self.mark = is_map, anchor, mark
        self.key, self.has_key, self.nodes, self.merges = None, False, 1, None

    def finish(self):
        if not self.merges:
            return self.value
        merged: dict = {}
        for source in self.merges:   # earlier merged mappings win over later ones, written keys over all
            for k, v in source.items():
                merged.setdefault(k, v)
        merged.update(self.value)
        return merged


def _error(problem: str, mark) -> yaml.MarkedYAMLError:
    return yaml.constructor.ConstructorError(None, None, problem, mark)


def _scalar(loader, event):
    tag = event.tag
    if tag is None or tag == "!":
        tag = loader.resolve(ScalarNode, event.value, event.implicit)
    if tag == _MERGE_TAG:
        return _MERGE
    if tag not in _SCALAR_TAGS:
        raise _error(f"the YAML tag {tag[:80]!r} is not supported in AutoSync files; write the plain value",
                     event.start_mark)
    try:
        value = loader.yaml_constructors[tag](loader, ScalarNode(tag, event.value, event.start_mark, event.end_mark))
    except ValueError:   # a number past Python's digit limit, a date that does not exist
        raise _error(f"cannot read the value {event.value[:40]!r}{'...' if len(event.value) > 40 else ''} "
                     f"as {tag.rsplit(':', 1)[-1]}", event.start_mark) from None
    if isinstance(value, str) and len(value) <= 64:
        value = sys.intern(value)   # the keys and names a spec repeats are held once
    return value


def construct_from_events(loader):
    """The plain data of the one document of ``loader``'s stream, built from its events (None for
    an empty stream).

    Raises:
        YAMLLimitError: past a limit above. yaml.YAMLError: bad YAML.
    """
    get_event = loader.get_event
    get_event()   # stream start
    if loader.check_event(StreamEndEvent):
        loader.get_event()
        return None
    loader.get_event()   # document start
    stack: list[_Container] = []
    anchors: dict[str, tuple[object, int]] = {}
    open_anchors: set[str] = set()
    scalars: dict = {}
    added = 0
    root = None
    while True:
        event = get_event()
        kind = type(event)
        if kind is ScalarEvent:
            # a spec repeats its keys and small values (var, ps, h0, true, 1): each distinct short
            # scalar is resolved once (resolving is most of the time a document costs)
            key = (event.tag, event.value, event.implicit) if len(event.value) <= 64 else None
            value = scalars.get(key, _MISSING) if key is not None else _MISSING
            if value is _MISSING:
                value = _scalar(loader, event)
                if key is not None and len(scalars) < _SCALAR_CACHE:
                    scalars[key] = value
            nodes = 1
            if event.anchor is not None:
                anchors[event.anchor] = (value, 1)
        elif kind is AliasEvent:
            if event.anchor in open_anchors:
                raise YAMLLimitError("a recursive alias (a node that contains itself); write the value out instead")
            if event.anchor not in anchors:
                raise yaml.composer.ComposerError(None, None, f"found undefined alias {event.anchor[:80]!r}",
                                                  event.start_mark)
            value, nodes = anchors[event.anchor]
            added += nodes
            if added > MAX_ALIAS_NODES:
                raise YAMLLimitError(
                    f"YAML aliases (*name) expand this document by more than the {MAX_ALIAS_NODES} nodes that "
                    f"aliases may add (at line {event.start_mark.line + 1}); write the values out instead of "
                    f"nesting anchors (&name)")
        elif kind is SequenceStartEvent or kind is MappingStartEvent:
            is_map = kind is MappingStartEvent
            if event.tag not in (_MAP_TAGS if is_map else _SEQ_TAGS):
                raise _error(f"the YAML tag {event.tag[:80]!r} is not supported in AutoSync files; write a plain "
                             f"{'mapping' if is_map else 'list'}", event.start_mark)
            if len(stack) >= MAX_DEPTH:
                raise YAMLLimitError(f"nesting deeper than {MAX_DEPTH} levels")
            if event.anchor is not None:
                open_anchors.add(event.anchor)
            stack.append(_Container(is_map, event.anchor, event.start_mark))
            continue
        elif kind is SequenceEndEvent or kind is MappingEndEvent:
            done = stack.pop()
            if done.has_key:
                raise _error("a mapping key without a value", done.mark)
            value, nodes = done.finish(), done.nodes
            if done.anchor is not None:
                open_anchors.discard(done.anchor)
                anchors[done.anchor] = (value, nodes)
        elif kind is DocumentEndEvent:
            break
        else:
            raise _error(f"unexpected YAML event {type(event).__name__}", event.start_mark)
        top = stack[-1] if stack else None
        if value is _MERGE and (top is None or not top.is_map or top.has_key):
            value = "<<"
        if top is None:
            root = value
            continue
        top.nodes += nodes
        if not top.is_map:
            top.value.append(value)
        elif not top.has_key:
            if value is not _MERGE:
                try:
                    hash(value)
                except TypeError:
                    raise _error(f"a mapping key must be a plain value, got a {type(value).__name__}",
                                 event.start_mark) from None
            if value is not _MERGE and value in top.value:
                # PyYAML keeps the last of two equal keys without a word: the first value, which
                # the writer meant too, would be dropped unseen
                raise _error(f"the key {str(value)[:80]!r} appears twice in one mapping (the second would "
                             f"silently replace the first); keep one", event.start_mark)
            top.key, top.has_key = value, True
        else:
            if top.key is _MERGE:
                sources = value if isinstance(value, list) else [value]
                if not all(isinstance(m, dict) for m in sources):
                    raise _error("a merge key (<<) takes a mapping or a list of mappings", event.start_mark)
                top.merges = (top.merges or []) + sources
            else:
                top.value[top.key] = value
            top.key, top.has_key = None, False
    if not loader.check_event(StreamEndEvent):
        event = loader.get_event()
        raise yaml.composer.ComposerError("expected a single document in the stream", None,
                                          "but found another document", event.start_mark)
    loader.get_event()
    return root


def _bounded(base: type) -> type:
    class Bounded(base):
        def get_single_data(self):
            return construct_from_events(self)

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{base.__name__}"
    # YAML 1.2 (and JSON) numbers that YAML 1.1 reads as strings: 1e1, 2E-3 (an exponent, no dot)
    Bounded.add_implicit_resolver("tag:yaml.org,2002:float",
                                  re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                  list("-+0123456789"))
    return Bounded


# libyaml's parser when PyYAML has it (~10x faster); the pure-Python one words syntax errors better
FastLoader = _bounded(getattr(yaml, "CSafeLoader", yaml.SafeLoader))
PlainLoader = _bounded(yaml.SafeLoader)
