"""An emulated multi-node Ray cluster on one Linux machine: network namespaces ``host0..`` on a
bridge, a tc rate limit on every link, one Ray node per namespace (``autosync testbed``).

Needs root. See ``Testbed`` for the Python API and ``state.load_cluster_spec`` for the
ClusterSpec that ``--cluster testbed`` resolves to.
"""
from __future__ import annotations

from .config import TestbedConfig, TestbedError, format_rate, parse_rate
from .testbed import DownReport, Testbed, down, exec_in_head, shape, status, up

__all__ = ["DownReport", "Testbed", "TestbedConfig", "TestbedError", "down", "exec_in_head", "format_rate",
           "parse_rate", "shape", "status", "up"]
