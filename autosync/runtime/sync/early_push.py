"""A parameter server's push issued from inside a worker's step, beside the step's collectives.

Where a strategy mixes parameter servers with all-reduce inside the training step (``graph``:
TensorFlow issues each fusion group's collective as soon as its gradients exist, while the backward
pass goes on), the PS gradients used to leave the worker only once the step had returned, i.e.
after its last collective: the push waited for the collective, and every worker's next pull for
the slowest push. On the testbed (dlrm-small, ``parallax``, 3 nodes at 100mbit,1gbit,1gbit,
emulated compute, ``--timeline``) worker 0's compute ended 19 ms before its PS push began.

A channel that declares ``pushes_early`` (its ``push`` only issues sends and waits for nothing: the
parameter servers') is handed its gradients as soon as every gradient it carries (``carries``:
variable indices) exists, while the collectives still run:

- a TensorFlow worker's step calls back from a ``tf.numpy_function`` on those gradients
  (``in_step``), which the runtime runs beside the collectives in its own thread;
- an emulated worker starts a thread that waits for their ready time (``EarlyPush.after``).

Not where the step is held (``global_clipnorm``, dynamic loss scaling: the scale needs every
channel's part first) nor where a step adds up several batches (gradient accumulation, a worker
holding several data parts: the sum exists only after the step). ``EarlyPush.done`` pushes
whatever the step did not (the same push, late) and raises what the early push raised.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np

from autosync.runtime.sync.base import hand_over


def wanted() -> bool:
    """Whether parameter servers push early: unless ``$AUTOSYNC_EARLY_PUSH`` is ``0`` (read on the
    driver where a session starts; ``benchmarks/early_push.py`` compares both)."""
    return os.environ.get("AUTOSYNC_EARLY_PUSH", "").strip() != "0"


def early_channels(channels: list, collectives_in_step: bool, held: bool, batches_per_step: int) -> list:
    """The channels a worker hands its gradients from inside the step (see the module doc):
    those that push early, where some collective runs in the step and the step is neither held
    nor a sum of several batches; else none."""
    if not collectives_in_step or held or batches_per_step != 1:
        return []
    return [c for c in channels if c.pushes_early]


class EarlyPush:
    """One worker's early push: its channels, the step it belongs to, and what it raised.

    A worker ``arm``s it before each step's compute (the step's number and the check its gradients
    must pass, e.g. that only pulled rows were read), the step calls it with the gradients
    (``__call__``, or ``after`` a delay in a thread), and ``done`` after the step.

    Args:
        channels: the channels pushed early (``early_channels``; none: nothing is pushed early).
        every: all of the worker's channels.

    Attributes:
        rest: the channels the worker still hands over after the step.
        carries: the variables whose gradients are pushed early.
        kept: those of them another channel after the step takes too (a variable split between
            the parameter servers and a collective outside the graph): the step returns them.
    """

    def __init__(self, channels: list, every: list):
        self.channels = list(channels)
        self.rest = [c for c in every if all(c is not e for e in self.channels)]
        self.carries = frozenset(v for c in self.channels for v in c.carries)
        after = frozenset(v for c in self.rest if not c.in_graph for v in c.carries) if channels else frozenset()
        self.kept = self.carries & after
        self._step, self._check, self._pushed, self._error, self._thread = 0, None, False, None, None

    def arm(self, step: int, check=None) -> None:
        self._step, self._check, self._pushed, self._error = step, check, False, None

    def __call__(self, grads: list) -> None:
        """Push ``grads`` (per variable, numpy; None where there is none) to the channels; an error
        is kept for ``done``, never raised into the caller (TensorFlow's runtime, or a thread)."""
        try:
            if self._check is not None:
                self._check(grads)
            hand_over(self.channels, self._step, grads, None)
        except BaseException as exc:   # noqa: BLE001 -- re-raised by ``done`` in the worker's thread
            self._error = exc
        self._pushed = True

    def after(self, delay_s: float, grads: list) -> None:
        """Push ``grads`` from a thread in ``delay_s`` seconds (an emulated worker's ready time)."""
        def run():
            time.sleep(max(0.0, delay_s))
            self(grads)

        self._thread = threading.Thread(target=run, name="early push", daemon=True)
        self._thread.start()

    def done(self, grads: list) -> None:
        """After the step: wait for a push ``after`` started, raise what the push raised, or push
        ``grads`` now where the step did not (nothing it carries had a gradient in the trace)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if not self._pushed and self.channels:
            if self._check is not None:
                self._check(grads)
            hand_over(self.channels, self._step, grads, None)
        self._pushed = True


def in_step(grads: list, early: EarlyPush):
    """Inside a traced step: hand the gradients ``early`` carries to it from a ``tf.numpy_function``
    as soon as they exist. Returns the gradients with those replaced by None (but ``early.kept``) and the function's
    output, which the step must return so that it runs (None where none was there to push)."""
    import tensorflow as tf

    flat, layout = [], []
    for v, g in enumerate(grads):
        if v in early.carries and g is not None:
            sparse = isinstance(g, tf.IndexedSlices)
            flat.extend([g.indices, g.values] if sparse else [g])
            layout.append((v, sparse))
    if not layout:
        return grads, None
    count = len(grads)

    def push(*arrays):
        out, parts = [None] * count, iter(arrays)
        for v, sparse in layout:
            out[v] = (next(parts), next(parts)) if sparse else np.asarray(next(parts))
        early(out)
        return np.int64(0)

    # not stateful: the step's automatic control dependencies would order it after the step's
    # other stateful ops (the collectives); its output is returned, so it runs all the same
    token = tf.numpy_function(push, flat, tf.int64, stateful=False, name="early_push")
    taken = {v for v, _ in layout} - early.kept
    return [None if v in taken else g for v, g in enumerate(grads)], token
