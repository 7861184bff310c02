"""What a checkpoint keeps of the numpy all-reduce channel (a mixin of
``allreduce.AllReduceChannel``): the local optimizer's slots and update count, and each worker's
compressor memory (error-feedback residuals, PowerSGD's warm-start Qs), and how they are set again
(from a checkpoint of another strategy too: ``reshard``)."""
from __future__ import annotations

import numpy as np

from autosync.runtime import optimizer_state
from autosync.runtime.reshard import ITERATION
from autosync.runtime.sync import compression


class AllReduceCheckpoint:
    """The checkpoint side of ``AllReduceChannel`` (its ``groups``, ``params``, ``_optimizer``,
    ``_version``, ``optimizer_config`` and compressors ``_ef``, ``_powersgd``, ``seed``)."""

    def checkpoint_state(self, names=None) -> dict:
        """The local optimizer's slots and update count (name -> array; only ``names`` when
        given); the values are the model's. Compressor memory (error feedback, PowerSGD's Q) is
        each worker's own: ``compressor_state``."""
        state = optimizer_state.save(self._optimizer, names) if self._optimizer is not None else {}
        return {**state, **({"version": np.array(self._version)} if names is None or "version" in names else {})}

    def checkpoint_sizes(self) -> dict:
        """name -> bytes of each array ``checkpoint_state`` returns."""
        return {**(optimizer_state.sizes(self._optimizer) if self._optimizer is not None else {}),
                "version": np.array(self._version).nbytes}

    def canonical_names(self) -> dict:
        """What each array ``checkpoint_state`` returns holds, in names any holder reads (``reshard``)."""
        if self._optimizer is None:
            return {"version": ITERATION}
        return optimizer_state.canonical_names(self._optimizer, "version")

    def load_checkpoint(self, values: list, state: dict, canonical: bool = False) -> list[str]:
        """Continue from ``checkpoint_state``'s arrays (``canonical``: named as any holder names
        them, ``reshard``); ``values``: every trainable variable's restored value (model order).
        Returns the problems found."""
        from autosync.runtime.optimizers import make_optimizer

        self.params = {m.key: np.array(m.take(values[m.key[0]]), copy=True) for g in self.groups for m in g.members}
        self._optimizer = make_optimizer(self.optimizer_config)
        for key, value in self.params.items():
            self._optimizer.add_variable(key, value)
        state = dict(state)
        self._version = int(state[ITERATION] if canonical else state.pop("version", 0))
        if not state:   # saved before the first update: the slots start as they are
            return []
        return optimizer_state.load(self._optimizer, self.params, state, canonical)

    def compressor_state(self) -> dict:
        """This worker's compressor memory (error-feedback residuals, PowerSGD's warm-start Qs) as
        named arrays (``compression.memory_arrays``)."""
        return compression.memory_arrays(self._ef, self._powersgd)

    def load_compressors(self, arrays: dict) -> list[str]:
        """Continue with ``compressor_state``'s arrays as this worker's compressor memory (none:
        it starts afresh). Returns the problems found (none: the names carry what they are)."""
        compression.load_memory(self._ef, self._powersgd, arrays, self.seed)
        return []
