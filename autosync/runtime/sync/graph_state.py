"""What a checkpoint keeps of the ``graph`` channel (a mixin of ``graph.GraphAllReduceChannel``):
the Keras optimizer's variables of the variables the channel reduces inside the step, and how
they are set again, from this channel's own names or from those any holder reads (``reshard``:
a checkpoint of another strategy)."""
from __future__ import annotations

import numpy as np


class GraphCheckpoint:
    """``checkpoint_state``, ``checkpoint_sizes``, ``canonical_names`` and ``load_checkpoint`` of
    the graph channel (its ``groups``, and what ``bind`` sets: ``_optimizer_variables``,
    ``_named``)."""

    def checkpoint_state(self, names=None) -> dict:
        """The Keras optimizer's variables (iterations, slots) of the variables reduced here, as
        ``"keras/<i>" -> array`` (only ``names`` when given). Compressor memory (fp16 error
        feedback, PowerSGD) is each worker's own: ``compressor_state``."""
        from autosync.runtime.optimizer_state import keras_state

        return keras_state(getattr(self, "_optimizer_variables", ()), names)

    def checkpoint_sizes(self) -> dict:
        """name -> bytes of each array ``checkpoint_state`` returns."""
        from autosync.runtime.optimizer_state import keras_state_sizes

        return keras_state_sizes(getattr(self, "_optimizer_variables", ()))

    def canonical_names(self) -> dict:
        """What each array ``checkpoint_state`` returns holds, in names any holder reads
        (``reshard``): a slot of a whole variable is ``"<var>/<slot>"``."""
        from autosync.runtime.reshard import keras_names

        prefixes, iterations = getattr(self, "_named", ({}, None))
        return keras_names(getattr(self, "_optimizer_variables", ()), prefixes, iterations)

    def load_checkpoint(self, values: list, state: dict, canonical: bool = False) -> list[str]:
        """Set the optimizer's variables from ``checkpoint_state``'s arrays (``canonical``: named
        as any holder names them, ``reshard``; the model's own variables hold the values).
        Returns the problems found."""
        from autosync.runtime.optimizer_state import keras_state, state_problems
        from autosync.runtime.reshard import from_keras_names, whole_slots

        variables = getattr(self, "_optimizer_variables", [])
        if canonical:
            names = self.canonical_names()
            members = [m for g in self.groups for m in g.members]
            found, problems = from_keras_names(names, whole_slots(state, members, names))
            if problems or not found:
                return problems
            state = {**keras_state(variables), **found}   # what it lacks stays as it is
        want = {f"keras/{i}": tuple(v.shape) for i, v in enumerate(variables)}
        problems = state_problems(want, state)
        if not problems:
            for i, v in enumerate(variables):
                v.assign(state[f"keras/{i}"])
        return problems

    def compressor_state(self) -> dict:
        """This worker's compressor memory in the graph (fp16 error-feedback residuals, PowerSGD's
        warm-start Qs and residuals) as ``"graph/<i>" -> array``, in the order ``bind`` made them."""
        return {f"graph/{i}": np.array(v.numpy()) for i, v in enumerate(getattr(self, "_memory", ()))}

    def load_compressors(self, arrays: dict) -> list[str]:
        """Continue with ``compressor_state``'s arrays (none: the memory starts afresh, as the
        checkpoint kept none). Returns the problems found (nothing is set then)."""
        from autosync.runtime.optimizer_state import state_problems

        memory = getattr(self, "_memory", ())
        if not arrays:
            return []
        problems = state_problems({f"graph/{i}": tuple(v.shape) for i, v in enumerate(memory)}, arrays)
        if not problems:
            for i, v in enumerate(memory):
                v.assign(arrays[f"graph/{i}"])
        return [p.replace("optimizer state", "compressor memory") for p in problems]
