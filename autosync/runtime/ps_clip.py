"""``global_clipnorm`` and dynamic loss scaling on a synchronous parameter-server actor: held steps.

Keras clips a step's gradients by the norm of all of them together. The shards of one step live
on several actors and channels, so none may update before all of them agree on the scale
(``sync.base``'s held steps). Per step ``t`` and worker, after its pushes:

    ``clip_norm(worker, t, local)``  waits until every worker's push of ``t`` (all chunks) and
                                     every worker's ``clip_norm`` are in, then returns this
                                     actor's part of the squared norm of the global-batch
                                     gradient: its dense shards' averaged gradients squared, plus
                                     the workers' ``local`` parts of its sparse shards (each a
                                     worker's slices squared one by one, as Keras squares
                                     ``IndexedSlices`` values; under gradient
                                     accumulation its sparse shards' summed rows)
                                     over ``num_workers ** 2``;
    ``clip_scale(t, scale, it)``     the scale every worker computed from the sum of all parts
                                     (None: skip the step, dynamic loss scaling) and the
                                     optimizer's count of updates before it; the first one received
                                     releases the update of ``t`` (the gradients times the scale),
                                     the others are ignored.

A step's update waits for its scale, so with ``global_clipnorm`` the pull of ``t + 1`` is served
one round trip after the last push of ``t`` (no chunk is updated before the whole step is in).
"""
from __future__ import annotations

import numpy as np

from autosync.runtime.slices import dedup_rows


class HeldSteps:
    """The held-step part of ``ps_shard.ParameterServerShard`` (module doc); it uses the actor's
    ``num_workers``, ``chunks``, ``version``, ``_pending``, ``_error``, ``_condition`` and
    ``_apply_complete_steps``."""

    def _setup_clip(self, optimizer_config: dict) -> None:
        from autosync.runtime.loss_scale import LOSS_SCALE

        self.clip = optimizer_config.get("global_clipnorm") if self.sync else None
        # every step is held under global_clipnorm or dynamic loss scaling (which may skip one)
        self.holds = self.sync and (self.clip is not None or optimizer_config.get(LOSS_SCALE) is not None)
        self._skipped = 0   # steps skipped so far: an update's iteration is its step less these
        # under gradient accumulation Keras clips the dense sum of a sparse gradient (repeated rows
        # added first): its part is then summed here, from every worker's rows
        self._clip_dense_rows = (optimizer_config.get("gradient_accumulation_steps") or 1) > 1
        self._scales: dict[int, tuple] = {}   # step -> (its scale or None: skipped, iteration), until applied
        self._norm_parts: dict[int, dict] = {}   # step -> worker -> its sparse part, as the workers ask
        self._norms: dict[int, float] = {}   # step -> this actor's part, kept one step after it is applied

    def _held(self, step: int) -> bool:
        """Whether the update of ``step`` waits for its scale."""
        return self.holds and step not in self._scales

    async def clip_norm(self, worker: int, step: int, local: float) -> float:
        """This actor's part of the squared global norm of ``step`` (module doc)."""
        part = self._norm_parts.setdefault(step, {})
        if worker in part:
            raise RuntimeError(f"{self.name}: worker {worker} asked the norm of step {step} twice")
        part[worker] = float(local)
        cond = self._condition()
        async with cond:
            cond.notify_all()
            await cond.wait_for(lambda: self._error is not None or step in self._norms
                                or (len(part) == self.num_workers and self._step_in(step)))
            if self._error:
                raise RuntimeError(self._error)
            if step not in self._norms:
                # in worker order, not arrival order: the same bits every run (``ordered_sum``)
                sparse = self._sparse_sq(step) if self._clip_dense_rows else sum(part[w] for w in sorted(part))
                self._norms[step] = self._dense_sq(step) + sparse / float(self.num_workers) ** 2
            return self._norms[step]

    async def clip_scale(self, step: int, scale, iteration: int | None = None) -> None:
        """Release the update of ``step`` with ``scale`` (None: skip it, dynamic loss scaling) as
        the optimizer's update ``iteration`` (None: ``step``); the first one received counts."""
        if self._error:
            raise RuntimeError(self._error)
        if step < self.version or step in self._scales:
            return
        self._scales[step] = (None if scale is None else float(scale), step if iteration is None else int(iteration))
        try:
            self._apply_complete_steps()
        except Exception as e:
            self._error = f"{self.name}: update for step {step} failed: {type(e).__name__}: {e}"
            raise
        finally:
            async with self._condition():
                self._condition().notify_all()

    def _step_in(self, step: int) -> bool:
        """Whether every worker's push of ``step`` is in, in every chunk."""
        n = self.num_workers
        return all((step, c) in self._pending and all(w == n for w in self._pending[(step, c)]["weight"].values())
                   for c in range(len(self.chunks)))

    def _dense_sq(self, step: int) -> float:
        n = float(self.num_workers)
        return sum(float(np.sum(np.square(total, dtype=np.float64))) for c in range(len(self.chunks))
                   for total in self._pending[(step, c)]["dense"].values()) / (n * n)

    def _sparse_sq(self, step: int) -> float:
        """The squared norm of the sparse shards' summed gradients, repeated rows added first
        (times ``num_workers ** 2``: the workers' sum, not yet their mean)."""
        total = 0.0
        for c in range(len(self.chunks)):
            for parts in self._pending[(step, c)]["sparse"].values():
                rows = np.concatenate([p[0] for p in parts])
                values = np.concatenate([p[1] for p in parts])
                total += float(np.sum(np.square(dedup_rows(rows, values, False)[1], dtype=np.float64)))
        return total

    def _clip_factor(self, step: int):
        """The scale the update of ``step`` multiplies its gradients by (None: no clipping)."""
        return None if self.clip is None else np.float32(self._scales[step][0])

    def _skips(self, step: int) -> bool:
        """Whether ``step`` is skipped (dynamic loss scaling: a reduced gradient not finite)."""
        return self.holds and self._scales[step][0] is None

    def _iteration(self, step: int) -> int:
        """The optimizer's count of updates before ``step``'s (Keras ``iterations``)."""
        return self._scales[step][1] if self.holds and step in self._scales else step - self._skipped

    def _clip_applied(self, step: int) -> None:
        """Forget what ``step`` needed once it is applied in every chunk (its norm one step later:
        a late reader of it is a worker not yet past that step)."""
        if self.holds:
            scale, iteration = self._scales.pop(step, (1.0, step - self._skipped))
            self._skipped = step - iteration + (scale is None)   # what the next step's update ahead counts
            self._norm_parts.pop(step, None)
            self._norms.pop(step - 1, None)
