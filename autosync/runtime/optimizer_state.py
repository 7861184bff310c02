"""An update rule's state (``optimizers.NumpyOptimizer`` slots, ``keras_optimizer.KerasOptimizer``
variables) as named arrays for a checkpoint, and back.

Names are ``"<var>.<shard>/<slot>"`` for the numpy rules and ``"keras/<i>"`` (the i-th of the
Keras optimizer's ``variables``) for a Keras optimizer. Loading checks names and shapes first and
changes nothing when they differ.
"""
from __future__ import annotations

import numpy as np

from autosync.runtime.reshard import ITERATION, from_numpy_names, key_text, numpy_names


def state_problems(want: dict, arrays: dict) -> list[str]:
    """Differences between the names and shapes expected (``want``: name -> shape) and ``arrays``."""
    problems = []
    missing, extra = sorted(set(want) - set(arrays)), sorted(set(arrays) - set(want))
    if missing:
        problems.append(f"optimizer state missing from the checkpoint: {', '.join(missing[:6])}")
    if extra:
        problems.append(f"optimizer state in the checkpoint that nothing here holds: {', '.join(extra[:6])}")
    for name in sorted(set(want) & set(arrays)):
        if tuple(arrays[name].shape) != tuple(want[name]):
            problems.append(f"optimizer state {name} has shape {tuple(arrays[name].shape)} in the checkpoint, "
                            f"{tuple(want[name])} here")
    return problems


def save(optimizer, names=None) -> dict:
    """The state of ``optimizer`` (``make_optimizer``'s result) as name -> array (copies); only
    the arrays ``names`` lists when given (a checkpoint reads a large state a batch at a time)."""
    if not hasattr(optimizer, "slots"):
        return optimizer.state(names)
    return {n: np.array(a) for n, a in _named(optimizer) if names is None or n in names}


def sizes(optimizer) -> dict:
    """name -> bytes of each array ``save`` returns, without copying any."""
    if not hasattr(optimizer, "slots"):
        return optimizer.state_sizes()
    return {n: int(a.nbytes) for n, a in _named(optimizer)}


def _named(optimizer):
    return ((f"{key_text(key)}/{name}", a) for key, slots in optimizer.slots.items() for name, a in slots.items())


def canonical_names(optimizer, counter: str | None = None) -> dict:
    """What each array ``save`` returns holds, in names any holder reads (``reshard``); a
    holder's own update counter ``counter`` (a name beside ``save``'s) is the optimizer's
    ``@iteration``."""
    names = numpy_names(optimizer.slots) if hasattr(optimizer, "slots") else optimizer.canonical_names()
    return {**names, **({counter: ITERATION} if counter else {})}


def load(optimizer, params: dict, arrays: dict, canonical: bool = False) -> list[str]:
    """Set the state of ``optimizer`` from ``save``'s arrays (with ``canonical``: from arrays
    named as ``canonical_names`` names them, of any holder: ``reshard``); ``params`` are the
    restored values it updates. Returns the problems found (nothing is set then)."""
    if not hasattr(optimizer, "slots"):
        return optimizer.load_state(params, arrays, canonical)
    if canonical:
        arrays = from_numpy_names(optimizer.slots, arrays)
        if not arrays:   # saved before any update: the slots start as they are
            return []
    want = {f"{key_text(key)}/{name}": a.shape for key, slots in optimizer.slots.items() for name, a in slots.items()}
    problems = state_problems(want, arrays)
    if not problems:
        for key, slots in optimizer.slots.items():
            for name in slots:
                slots[name] = owned(arrays[f"{key_text(key)}/{name}"], slots[name].dtype)
    return problems


def owned(array, dtype) -> np.ndarray:
    """``array`` as an array of ``dtype`` this process may update in place: itself when it is a
    writeable array of that dtype (a copy made here, handed over), else a copy (a read-only view
    of the object store)."""
    if isinstance(array, np.ndarray) and array.dtype == dtype and array.flags.writeable and array.flags.c_contiguous:
        return array
    return np.array(array, dtype=dtype, copy=True)


def keras_state(variables, names=None) -> dict:
    """Keras variables as ``"keras/<i>" -> array`` (copies), only ``names`` when given."""
    return {f"keras/{i}": np.array(v.numpy()) for i, v in enumerate(variables)
            if names is None or f"keras/{i}" in names}


def keras_state_sizes(variables) -> dict:
    """name -> bytes of each array ``keras_state`` returns."""
    return {f"keras/{i}": int(np.prod(v.shape, dtype=np.int64)) * np.dtype(v.dtype).itemsize
            for i, v in enumerate(variables)}
