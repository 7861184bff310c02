"""The names Keras gives a model's layers, the same in every process that builds it.

A layer created without a name is named from a process-wide counter: the first ``Dense`` is
``dense``, the next ``dense_1``. Variables are named by their layer's path (``dense_1/kernel``),
and strategies name variables. A driver that had built the model once already (a notebook that
tried it, a benchmark going through several models, a user's check before ``make_trainer``) named
the same variables ``dense_2/...`` where a fresh worker named them ``dense/...``, and every
strategy was refused for naming variables the other side did not have.

So ``ModelDef.build_model`` builds under counters of its own, started from ``ModelDef.name_counts``
(empty: the names a fresh process gives; a script whose top level named Keras objects, such as a
module-level layer the model reuses, sets them to the counters right after its import, so that the
model's own layers never take that layer's name), and gives the process its counters back
afterwards: the user's own builds go on numbering as if AutoSync had built nothing.
"""
from __future__ import annotations

import collections
import contextlib
import sys

_KEY = "object_name_uids"   # keras.src.utils.naming keeps its counters under this global attribute
_SCOPES = "name_scope_stack"  # and keras.src.backend.common.name_scope the open scopes under this one


def _state():
    return _global_state() if "keras" in sys.modules else None


def _global_state():
    """Keras' process-wide state (a module of Keras' internals), or None where this Keras has none."""
    try:
        from keras.src.backend.common import global_state
    except ImportError:
        return None
    return global_state


def counts() -> dict:
    """A copy of this process's name counters ({} where Keras was never imported)."""
    state = _state()
    if state is None:
        return {}
    return dict(state.get_global_attribute(_KEY) or {})


@contextlib.contextmanager
def counting_from(start: dict | None):
    """Name Keras objects created inside from counters set to ``start`` (None: from nothing), and
    outside any name scope: a traced step that failed while entering one (a layer name TensorFlow
    refuses) leaves Keras' scope stack behind, and every variable built after it in that process
    was prefixed with the scope (``functional/dense/kernel``). This process's own counters and
    scopes are put back on the way out, exceptions included. (A Keras that keeps them elsewhere:
    the build runs as it is.)"""
    state = _global_state()
    if state is None:
        yield
        return
    saved = {key: state.get_global_attribute(key) for key in (_KEY, _SCOPES)}
    state.set_global_attribute(_KEY, collections.defaultdict(int, start or {}))
    state.set_global_attribute(_SCOPES, [])
    try:
        yield
    finally:
        for key, value in saved.items():
            state.set_global_attribute(key, value)


@contextlib.contextmanager
def scopes_closed_on_failure():
    """Close the Keras name scopes that code failing inside left open (TensorFlow refusing a scope
    name raises after Keras opened its own): the process's later builds are not prefixed by them."""
    state = _global_state()
    if state is None:
        yield
        return
    before = list(state.get_global_attribute(_SCOPES) or [])
    try:
        yield
    except BaseException:
        state.set_global_attribute(_SCOPES, before)
        raise
