"""What ``Trainer.fit`` hands back and whom it calls: the History of its steps, and the user's
callbacks checked and made into plain functions before the first step runs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from strategy_space.errors import ConfigError, short_repr

StepCallback = Callable[[int, dict], None]


@dataclass
class History:
    """What ``fit`` did.

    Attributes:
        loss: per step, the mean over workers of each worker's batch loss.
        step_times: per step, seconds (the slowest worker).
        wall_times: per step, wall-clock seconds from the start of the ``fit`` call to the end of
            the step (the last worker's), driver round trips included: what loss against time
            is plotted over.
        restarts: one dict per recovery from a failure (``fit(max_failures=...)``):
            ``{"failed_at": the global step when the failure surfaced, "resumed_from": the
            checkpoint's step, "error": what failed, "seconds": from the failure to training
            again}``; after an elastic ``fit`` went on without nodes that left, also
            ``"without"`` or, where a replacement had joined, ``"replaced"`` (their names),
            ``"workers"`` (how many train now) and ``"strategy"`` (the re-placed strategy's
            fingerprint); when an elastic ``fit`` took its nodes back at a checkpoint,
            ``{"back": their names, "resumed_from", "workers", "strategy", "seconds"}`` (no
            failure). Steps redone after a restart are recorded
            once, so the lists above hold one entry per step.
    """

    loss: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    wall_times: list = field(default_factory=list)
    restarts: list = field(default_factory=list)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` steps (a restart redoes the steps after its checkpoint)."""
        del self.loss[n:], self.step_times[n:], self.wall_times[n:]

    @property
    def history(self) -> dict:
        """Keras-style ``{"loss": [...], "step_time_s": [...], "wall_time_s": [...]}``."""
        return {"loss": list(self.loss), "step_time_s": list(self.step_times), "wall_time_s": list(self.wall_times)}


def step_callbacks(callbacks) -> list[StepCallback]:
    """``fit``'s callbacks as functions ``fn(step, logs)``: each given one a function or an object
    with ``on_step_end(step, logs)``; a list of them, or one alone.

    Raises:
        ConfigError: anything else (a Keras callback, which has no ``on_step_end``, among them),
            before any step runs.
    """
    if callable(callbacks) or hasattr(callbacks, "on_step_end"):
        callbacks = [callbacks]
    if isinstance(callbacks, (str, bytes, dict)) or not hasattr(callbacks, "__iter__"):
        raise ConfigError(f"callbacks must be a list of functions fn(step, logs) or objects with "
                          f"on_step_end(step, logs), got {type(callbacks).__name__} {short_repr(callbacks)}")
    calls = []
    for i, cb in enumerate(callbacks):
        call = getattr(cb, "on_step_end", None) if hasattr(cb, "on_step_end") else cb
        if not callable(call):
            raise ConfigError(f"callbacks[{i}] is neither a function fn(step, logs) nor an object with a method "
                              f"on_step_end(step, logs): got {type(cb).__name__} {short_repr(cb)}"
                              + (" (a Keras callback acts on keras.Model.fit's loop: its epochs and its model, which "
                                 "Trainer.fit does not run; write a function of the step's logs instead, and set "
                                 "trainer.stop_training = True in it to stop early)"
                                 if hasattr(cb, "on_train_batch_end") else ""))
        calls.append(call)
    return calls
