"""What a checkpoint reads of a training worker and how a worker continues from one.

A mixin of ``TrainingWorker`` (``autosync.runtime.worker``): the driver's checkpoint
(``autosync.runtime.checkpoint``) lists a worker's state with ``checkpoint_state``, reads it a batch
at a time with ``checkpoint_part``, and on restore sets the weights with ``assign_weights`` and the
rest with ``restore_checkpoint``.
"""
from __future__ import annotations

import numpy as np

from autosync.runtime import prefetch, random_seeds, weights_file


class WorkerCheckpoint:
    """The checkpoint side of a ``TrainingWorker`` (uses its model, variables, channels, layout,
    row reads, data iterator and step counter)."""

    def checkpoint_state(self, with_sizes: bool) -> dict:
        """What a checkpoint keeps of this worker, between round trips: ``step``, ``position``
        (batches drawn from each of its data parts), ``parts`` (``[its parts, how many]``), ``seeds``
        (its random layers' generator states, ``random_seeds``: a few bytes each), ``loss_scale``
        (dynamic loss scaling's state, or None), and with
        ``with_sizes`` each model weight's shape and dtype (``weights``, ``get_weights`` order),
        the index there of each trainable variable (``trainable``), per channel the bytes of
        each array of its state (``channels``: None for a channel that keeps none) and what each
        holds (``canonical``, ``reshard``), and the weights file's layout (``layout``, see
        ``weights_file``); ``checkpoint_part`` then reads them a batch at a time."""
        parts = self._parts   # each of its data parts drew as many batches (``data_parts``)
        out = {"step": self.step, "position": self.drawn // len(parts[0]), "parts": [list(parts[0]), parts[1]],
               "seeds": [np.array(v.numpy()) for v, _ in self._seeds],
               "loss_scale": self._loss_scale.state() if getattr(self, "_loss_scale", None) else None}
        if with_sizes:
            where = {id(w): i for i, w in enumerate(self.model.weights)}
            out["weights"] = [(tuple(w.shape), str(np.dtype(w.dtype))) for w in self.model.weights]
            out["trainable"] = [where[id(v)] for v in self.variables]
            out["channels"] = [c.checkpoint_sizes() if hasattr(c, "checkpoint_state") else None for c in self.channels]
            out["canonical"] = [c.canonical_names() if hasattr(c, "canonical_names") else {} for c in self.channels]
            out["layout"] = weights_file.layout(self.model)   # a walk of the model: milliseconds
        return out

    def checkpoint_part(self, weights: list, channels: dict) -> dict:
        """Model weights by index (``{"weights": {i: array}}``) and channel state by channel
        and name (``{"channels": {c: {name: array}}}``), as ``checkpoint_state`` listed them. A
        row-pulled table is read whole: from its parameter servers, which hold it whole (this
        model is current only on the rows last read), or written whole here first where a
        channel of this worker holds it (all-reduced)."""
        if self._partial:
            self._assign_held_whole()
        every = self.model.weights
        return {"weights": {i: np.array(every[i].numpy()) for i in weights},
                "channels": {c: self.channels[c].checkpoint_state(names) for c, names in channels.items()}}

    def _assign_held_whole(self) -> None:
        """Write whole into the model the row-pulled tables that a channel holding its values
        here (``holds_values``: all-reduce) pulled by rows."""
        parts: dict = {}
        for channel in self.channels:
            if getattr(channel, "holds_values", False):
                parts.update(channel.pull(self.step, fresh=True))
        whole = {}
        for v in self.row_reads.outputs:
            shards, axis = self.layout[v]
            got = [parts.get((v, i)) for i in range(shards)]
            if all(isinstance(p, np.ndarray) for p in got):
                whole[v] = got[0] if shards == 1 else np.concatenate(got, axis=axis)
        self._assign_each(whole)

    def compressor_state(self) -> dict:
        """This worker's compressor memory (error-feedback residuals, PowerSGD's warm-start Qs: its
        own, unlike the optimizer state every worker shares) as ``"channel<c>/<name>" -> array``."""
        return {f"channel{c}/{k}": a for c, channel in enumerate(self.channels)
                if hasattr(channel, "compressor_state") for k, a in channel.compressor_state().items()}

    def assign_weights(self, part: dict) -> None:
        """Set model weights by index (``get_weights`` order): a restore sends them in batches."""
        every = self.model.weights
        for i, value in part.items():
            every[i].assign(value)

    def restore_checkpoint(self, position: int, step: int, channels: list, seeds: list | None = None,
                           loss_scale: list | None = None, canonical: bool = False,
                           compressors: dict | None = None) -> list[str]:
        """Continue from a checkpoint (after ``reset``, the weights set by ``assign_weights``):
        the data iterator advanced to ``position`` batches (of each of its data parts), the step
        counter, each channel's state and the random layers' generator states (as ``checkpoint_state`` gave them; None:
        a checkpoint that holds none, written before they were kept, and the streams start
        afresh) and dynamic loss scaling's state (``loss_scale.LossScale.state``; None: it starts
        afresh). With ``canonical``, ``channels`` is one state named as any holder names it
        (``reshard``: a checkpoint of another strategy), each channel taking its own part.
        ``compressors``: this worker's ``compressor_state`` (None: the memory starts afresh).
        Returns the problems found."""
        if canonical:
            channels = [channels[0]] * len(self.channels)
        if len(channels) > len(self.channels):
            return [f"the checkpoint holds state of {len(channels)} synchronization channels, the worker has "
                    f"{len(self.channels)}"]
        if seeds is not None:
            if len(seeds) != len(self._seeds) or any(np.shape(s) != (2,) for s in seeds):
                return [f"the checkpoint holds the state of {len(seeds)} random-layer generators (Dropout, noise, "
                        f"...), the model has {len(self._seeds)}: its random layers differ from the checkpoint's, "
                        f"or the checkpoint is damaged"]
            random_seeds.assign([v for v, _ in self._seeds], seeds)
        channels = list(channels) + [None] * (len(self.channels) - len(channels))
        keep = any(hasattr(c, "load_checkpoint") for c in self.channels)   # all-reduced variables' optimizer
        values = [np.asarray(v.numpy()) for v in self.variables] if keep else []
        problems = []
        for c, (channel, state) in enumerate(zip(self.channels, channels)):
            if hasattr(channel, "load_checkpoint"):
                problems += channel.load_checkpoint(values, state or {}, canonical)
            if hasattr(channel, "load_compressors"):
                prefix = f"channel{c}/"
                problems += channel.load_compressors({k[len(prefix):]: a for k, a in (compressors or {}).items()
                                                      if k.startswith(prefix)})
        self.batches = prefetch.restart(self.batches, self._stream())
        self.drawn = 0
        for _ in range(int(position) * len(self._parts[0])):   # iterators cannot seek: draw and drop
            self._next_batch()
        if loss_scale is not None and getattr(self, "_loss_scale", None) is not None:
            self._loss_scale.load(loss_scale)
            self._set_scale()
        self.step = int(step)
        self._trained = True
        self._partial = False
        return problems
