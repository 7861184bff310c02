"""An in-process collective backend for the fast tests: ranks are threads of the test process
(``autosync.runtime.sync.inprocess``, which the accelerator efficiency benchmark uses too), and the
contract suites' helper that lists every implementation of a base class.
"""
from __future__ import annotations

from autosync.runtime.sync.inprocess import TIMEOUT_S, ThreadBackend, ThreadGroup, run_ranks

__all__ = ["TIMEOUT_S", "ThreadBackend", "ThreadGroup", "concrete_subclasses", "run_ranks"]


def concrete_subclasses(base: type) -> set:
    """Every non-abstract class under ``base`` (imported so far): what a contract suite must cover."""
    found, todo = set(), [base]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if not getattr(cls, "__abstractmethods__", None):
            found.add(cls)
    return found
