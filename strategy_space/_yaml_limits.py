"""Bounded YAML loading: every file AutoSync reads (strategy, model spec, cluster, constraints)
goes through these loaders, which refuse input that would expand far beyond its own size.

A YAML alias (``*name``) refers to an anchored node (``&name``); a few kilobytes of nested
anchors stand for a document of billions of nodes (an "alias bomb"). PyYAML builds such a
document as shared Python objects, cheaply, but everything that later walks it (validation,
fingerprints, an error message's repr) walks the whole expansion. So the composed node graph is
measured before anything is built from it: how many nodes the document has once every alias is
expanded (counted per distinct node, so the count itself costs the size of the file), and how
deeply it nests. Recursive aliases are refused too.
"""
from __future__ import annotations

import reprlib

import yaml

# Nodes that aliases may add on top of the written ones: far above any real spec (AutoSync's own
# files use no aliases; a 5,000-variable model sharing one anchored synchronizer adds ~25,000),
# and small enough that walking that many values stays a fraction of a second.
MAX_ALIAS_NODES = 100_000
# Nesting depth: AutoSync's formats nest about 6 deep.
MAX_DEPTH = 64
# Largest file read (a full-size model spec with thousands of variables is a few MiB).
MAX_FILE_BYTES = 64 * 1024 * 1024


class YAMLLimitError(yaml.YAMLError):
    """A document past the limits above; ``str`` says which and by how much."""


def _measure(root: yaml.Node) -> tuple[int, int]:
    """(nodes written, nodes after expanding aliases) of the graph under ``root``.

    Iterative (no recursion limit), each distinct node visited once.

    Raises:
        YAMLLimitError: a recursive alias, or nesting deeper than MAX_DEPTH.
    """
    expanded: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        key = id(node)
        children = ([c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode)
                    else node.value if isinstance(node, yaml.SequenceNode) else [])
        if done:
            on_path.discard(key)
            expanded[key] = 1 + sum(expanded[id(c)] for c in children)
            continue
        if key in expanded:
            continue
        if key in on_path:
            raise YAMLLimitError("a recursive alias (a node that contains itself); write the value out instead")
        if depth > MAX_DEPTH:
            raise YAMLLimitError(f"nesting deeper than {MAX_DEPTH} levels")
        on_path.add(key)
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in children if id(c) not in expanded)
    return len(expanded), expanded[id(root)]


def _check(node: yaml.Node | None) -> yaml.Node | None:
    if node is not None:
        written, total = _measure(node)
        if total - written > MAX_ALIAS_NODES:
            raise YAMLLimitError(
                f"YAML aliases (*name) expand this document of {written} nodes to {reprlib.repr(total)} nodes, "
                f"more than the {MAX_ALIAS_NODES} that aliases may add; write the values out instead of "
                f"nesting anchors (&name)")
    return node


def _bounded(base: type) -> type:
    class Bounded(base):
        def get_single_node(self):
            return _check(super().get_single_node())

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{base.__name__}"
    return Bounded


# libyaml's loader when PyYAML has it (~10x faster); the pure-Python one words syntax errors better
FastLoader = _bounded(getattr(yaml, "CSafeLoader", yaml.SafeLoader))
PlainLoader = _bounded(yaml.SafeLoader)
