"""A parameter-server actor's part in checkpoints (a mixin of ``ps_shard.ParameterServerShard``):
its state read a bounded batch at a time, and a restore received the same way.

A restore sends a server's shard values and optimizer slots in batches (``stage_checkpoint``,
about ``session_state.BATCH_BYTES`` each) and ends with ``load_checkpoint``, which checks the whole
and takes it: what the driver and the object store hold at once is one batch, not the server's
state (a 2 GB embedding table with its Adagrad slots), and the server keeps one copy of each
array it received, taken over as its state without another.
"""
from __future__ import annotations

import numpy as np

from autosync.runtime import optimizer_state


class Checkpointed:
    """``checkpoint_state``, ``stage_checkpoint`` and ``load_checkpoint`` of a PS actor (its
    ``params``, ``optimizer``, counters and ``_staged``, set up by the actor)."""

    async def checkpoint_state(self, names=None, values=()) -> dict:
        """What a checkpoint reads of this actor, a bounded batch at a time: ``{"version",
        "chunk_version", "sizes": name -> bytes, "canonical": name -> what it holds (``reshard``),
        "slots": name -> array, "values": key -> array}``,
        the slots only those ``names`` lists when given, the values of the shard keys ``values``.

        Raises:
            RuntimeError: updates are pending (a checkpoint is taken between round trips, when
                every push of the steps run is applied).
        """
        if self._error:
            raise RuntimeError(self._error)
        if self._pending:
            steps = sorted({s for s, _ in self._pending})
            raise RuntimeError(f"{self.name}: a checkpoint was asked while steps {steps} are still being pushed")
        return {"version": self.version, "chunk_version": list(self.chunk_version),
                "sizes": optimizer_state.sizes(self.optimizer), "slots": optimizer_state.save(self.optimizer, names),
                "canonical": optimizer_state.canonical_names(self.optimizer),
                "values": self.optimizer.snapshots(self.params, list(values))}

    async def stage_checkpoint(self, values: dict, slots: dict) -> None:
        """Part of a restore: shard values (key -> array) and optimizer slots (name -> array), kept
        (copied out of the object store) until ``load_checkpoint`` takes them all."""
        staged_values, staged_slots = self._staged
        staged_values.update((k, np.array(v, copy=True)) for k, v in values.items())
        staged_slots.update((k, np.array(v, copy=True)) for k, v in slots.items())

    async def load_checkpoint(self, values: dict, slots: dict, version: int, chunk_version: list | None,
                              canonical: bool = False) -> list[str]:
        """Continue from a checkpoint: shard values (key -> array) and the optimizer's slots, with
        those ``stage_checkpoint`` received before, and the update counters (``chunk_version``
        None: every chunk at ``version``). With ``canonical`` the slots are named as any holder
        names them (``reshard``: a checkpoint of another strategy). Returns the problems found
        (nothing is changed then; what was staged is dropped either way)."""
        (staged_values, staged_slots), self._staged = self._staged, ({}, {})
        values, slots = {**staged_values, **values}, {**staged_slots, **slots}
        del staged_values, staged_slots
        problems = [f"{self.name}: the checkpoint has no value for shard {k}" for k in self.params if k not in values]
        problems += [f"{self.name}: shard {k} has shape {np.shape(values[k])} in the checkpoint, "
                     f"{np.shape(self.params[k])} here" for k in self.params
                     if k in values and np.shape(values[k]) != np.shape(self.params[k])]
        chunk_version = [version] * len(self.chunks) if chunk_version is None else chunk_version
        if len(chunk_version) != len(self.chunks):
            problems.append(f"{self.name}: the checkpoint has {len(chunk_version)} chunk counters, this actor "
                            f"{len(self.chunks)} chunks")
        if problems:
            return problems
        old = self.params
        self.params = {k: optimizer_state.owned(values.pop(k), old[k].dtype) for k in old}
        problems = optimizer_state.load(self.optimizer, self.params, slots, canonical)
        if problems:
            self.params = old
            return [f"{self.name}: {p}" for p in problems]
        for key in self.params:
            self.optimizer.adopt(self.params, key)
        self.version, self.chunk_version = int(version), [int(v) for v in chunk_version]
        self._shared, self._asked = {}, {}
        return []
