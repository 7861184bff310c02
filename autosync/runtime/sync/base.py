"""What every worker-side synchronization has in common: the channel and the collective backend.

A worker's step is always: draw the batch, ``values = channel.pull(step, rows=rows)`` (assign
them), compute gradients, ``channel.push(step, grads)``. Each synchronizer kind is a channel:

- ``ps.PSChannel``: pushes each PS actor's gradient shards in ONE call and pulls its shards in
  ONE call per step, whatever the number of variables.
- ``allreduce.AllReduceChannel``: ``push`` reduces the fusion groups through a collective backend
  (``backends``: gloo, nccl, the object store, TensorFlow's collectives called eagerly) and applies
  the local optimizer, ``pull`` returns the locally updated values.
- ``graph.GraphAllReduceChannel``: reduces its groups and applies the Keras optimizer inside the
  worker's training step; its ``pull``/``push`` have nothing left to do.

``pull(step, fresh=False, rows=None)`` returns values per ``(var_index, shard_index)``; the worker
puts each variable together from the parts of every channel, so one variable's shards may be
split between PS and all-reduce. ``rows`` maps a sparse variable's index to the sorted unique
int64 row ids (of the whole variable) the step reads; for its shards a channel may return
``(row_ids, values)`` (row ids of the whole variable, values of those rows) instead of the whole
shard: the PS channel does, so only those rows cross the network. A variable not in ``rows`` is
returned whole. A channel that holds its values locally (all-reduce) ignores ``rows``.

Gradients are given per model variable: a dense ndarray, ``(indices, values)`` for a sparse
(IndexedSlices) gradient, or None (no gradient: nothing is sent). The PS channel sums the
slices of repeated rows before sending (``slices.dedup_rows``), except for an optimizer that
transforms each slice (``optimizers.sparse_form``), whose slices travel as they are.

With the optimizer's ``global_clipnorm`` the worker runs a step in three parts instead of
``push`` (``clip_scale`` below): ``held = push_held(step, grads)`` hands the gradients over
without updating; ``held_sq(held)`` is this channel's part of the squared norm of the step's
global-batch gradient (a parameter server's once every worker's push is in); the worker sums the
parts of every channel, and ``release(step, scale)`` updates with the gradients times the scale,
the same on every worker and shard. Dynamic loss scaling holds every step the same way and skips
one whose sum is not finite (``hand_over``, ``loss_scale``).

Every channel counts ``calls`` (Ray calls) and ``bytes_sent``/``bytes_received`` (array payload
bytes, both directions) so the runtime can report what a step moved.

A ``CollectiveBackend`` is one worker's end of a collective group (``allreduce``, ``allgather``);
the registry of backends is ``backends.resolve_backend``.
"""
from __future__ import annotations

import abc
from typing import Any

import numpy as np

from autosync.runtime import timeline
from autosync.runtime.loss_scale import SKIP


class SyncChannel(abc.ABC):
    """The synchronization of some variables, seen from one worker.

    Besides ``pull``/``push``, a channel declares three optional abilities (the worker reads these
    declarations; it never probes a channel for methods):

    - ``splits_pull``: ``start_pull`` issues a pull without waiting and ``finish_pull`` collects
      it, so with ``staleness >= 1`` on every channel the worker issues step t+1's pull before it
      computes step t. By default ``start_pull`` pulls at once.
    - ``in_graph``: the channel reduces and applies its gradients inside the training step;
      ``bind`` returns that step.
    - ``pushes_early``: ``push`` only issues its sends and waits for nothing, so a worker may push
      from inside its step as soon as the gradients it ``carries`` exist, beside the step's
      collectives (``early_push``).

    Attributes:
        calls: Ray actor calls issued so far (the overhead the runtime is measured by).
        bytes_sent, bytes_received: array payload bytes moved so far.
        staleness: how many steps this worker may run ahead of the slowest one (0: none).
        splits_pull: whether ``start_pull`` returns before the values are there (see above).
        in_graph: whether ``bind`` supplies the worker's training step (see above).
        pushes_early: see above.
        carries: the variables (indices) whose gradients ``push`` takes; a channel outside the
            graph declares them (``early_push`` returns them from the step for it).
    """

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    staleness: int = 0
    splits_pull: bool = False
    in_graph: bool = False
    pushes_early: bool = False
    carries: frozenset = frozenset()
    phase: str = "sync"   # the name of its hand-over on a timeline (``timeline``)

    @abc.abstractmethod
    def pull(self, step: int, fresh: bool = False, rows: dict | None = None) -> dict:
        """Values of this channel's shards to compute ``step`` with: (var, shard) -> array, or
        ``(row_ids, values)`` for a variable in ``rows`` (see the module doc).

        ``fresh`` waits for every update before ``step`` (no staleness allowance)."""

    @abc.abstractmethod
    def push(self, step: int, grads: list) -> None:
        """Hand over this worker's gradients of ``step`` (all variables, model order)."""

    @abc.abstractmethod
    def push_held(self, step: int, grads: list) -> Any:
        """Hand over this worker's gradients of ``step`` without updating (see the module doc);
        the result goes to ``held_sq``."""

    @abc.abstractmethod
    def held_sq(self, held: Any) -> float:
        """This channel's part of the step's squared global gradient norm (waits for it)."""

    @abc.abstractmethod
    def release(self, step: int, scale, iteration: int | None = None) -> None:
        """Update with the held gradients of ``step`` times ``scale``; with ``scale`` ``SKIP`` (dynamic
        loss scaling, a gradient not finite) drop them, updating nothing. ``iteration``: the
        optimizer's count of updates before this one where skipped steps make it differ from
        ``step`` (None: no step is ever skipped)."""

    def finalize(self) -> None:
        """The end of ``fit`` under the optimizer's ``use_ema``: the values held here take their
        moving averages (parameter servers are finalized by the driver)."""

    def start_pull(self, step: int, fresh: bool = False, rows: dict | None = None) -> Any:
        """Issue the pull of ``step`` (arguments as ``pull``); ``finish_pull`` of the result returns
        its values. Unless ``splits_pull``, this pulls at once."""
        return self.pull(step, fresh=fresh, rows=rows)

    def finish_pull(self, pending: Any) -> dict:
        """The values of a pull issued by ``start_pull``."""
        return pending

    def bind(self, model, loss_fn, optimizer, hold: bool = False):
        """The worker's training step ``(x, y) -> (loss, grads)`` for a channel that is
        ``in_graph`` (the gradients it applied come back as None; with ``hold``, the gradients it
        reduced are kept for ``release`` instead: see the module doc).

        Raises:
            NotImplementedError: for a channel that is not ``in_graph``.
        """
        raise NotImplementedError(f"{type(self).__name__} synchronizes outside the training step (in_graph is "
                                  f"False): it has no step to bind")

    def finish(self) -> None:
        """Wait for outstanding work and surface its errors."""

    def close(self) -> None:
        """Release what the channel holds open (sockets); the worker calls it when the channel is
        replaced by the next trial's."""


def clip_scale(squared_norm: float, clipnorm: float) -> np.float32:
    """What Keras multiplies a step's gradients by for ``global_clipnorm`` (its
    ``clip_by_global_norm``, in float32): ``clipnorm / norm`` above ``clipnorm``, else 1; NaN when
    the norm is not finite."""
    norm = np.sqrt(np.float32(squared_norm))
    clip = np.float32(clipnorm)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return clip * np.minimum(np.float32(1) / norm, np.float32(1) / clip) + (norm - norm)


def shard_gradient(grad, start: int, stop: int, axis: int, num_shards: int):
    """The part of a full-variable gradient that belongs to shard ``[start, stop)`` along ``axis``:
    a view of a dense array, or the rows of a sparse ``(indices, values)`` pair, re-indexed."""
    if num_shards == 1:
        return grad
    if isinstance(grad, tuple):
        indices, values = grad
        mask = (indices >= start) & (indices < stop)
        return indices[mask] - start, values[mask]
    return grad[(slice(None),) * axis + (slice(start, stop),)]


class CollectiveBackend(abc.ABC):
    """One worker's end of a collective group."""

    name: str = ""

    @classmethod
    def prepare(cls, world: int, group: str, actor_options: dict | None = None) -> Any:
        """Driver side, once per worker pool; the result is passed to ``connect``.
        ``actor_options`` place any helper actor (e.g. on the chief node)."""
        return group

    @classmethod
    @abc.abstractmethod
    def connect(cls, rank: int, world: int, setup: Any) -> "CollectiveBackend":
        """Worker side: join the group."""

    @abc.abstractmethod
    def allreduce(self, buf: np.ndarray, tag: str) -> np.ndarray:
        """Element-wise sum of ``buf`` over all workers (``tag`` names the call: one per group
        and step, equal on every worker)."""

    @abc.abstractmethod
    def allgather(self, arr: np.ndarray, tag: str) -> list[np.ndarray]:
        """Every worker's ``arr`` (lengths along axis 0 may differ), in rank order."""

    def close(self) -> None:
        """Leave the group."""


def across_collective(channels: list) -> bool:
    """Whether a worker's next pulls are worth issuing before this step's collective: some channel
    splits its pull (a parameter server's values come back while the worker does something else)
    and another reduces after the step, in its ``push`` (an all-reduce channel, not in the graph),
    which the pulls would otherwise wait behind. Measured on the testbed (2 nodes at 200mbit, real
    compute), a parallax step on ncf-small issued its pulls only after its all-reduce had run."""
    return (any(c.splits_pull for c in channels)
            and any(not c.splits_pull and not c.in_graph for c in channels))


def hand_over(channels: list, step: int, grads: list, clipnorm: float | None, loss_scale=None) -> None:
    """Give every channel a step's gradients: pushed, or under ``global_clipnorm`` (``clipnorm``
    given) or dynamic loss scaling (``loss_scale``: the worker's ``loss_scale.LossScale``) as a held
    step, every channel's part of the squared norm summed into the scale each then releases its
    update with (what a TensorFlow or an emulated worker does). Under loss scaling a sum that is not
    finite (some reduced gradient is not) releases the step with ``SKIP``: no channel updates; and
    ``loss_scale`` moves on, the same on every worker."""
    if clipnorm is None and loss_scale is None:
        for channel in channels:
            with timeline.span(getattr(channel, "phase", "sync"), step=step):
                channel.push(step, grads)
        return
    held = []
    for channel in channels:
        with timeline.span(f"{getattr(channel, 'phase', 'sync')} (held)", step=step):
            held.append(channel.push_held(step, grads))
    with timeline.span("global norm", step=step):
        squared = sum(c.held_sq(h) for c, h in zip(channels, held))
        scale = np.float32(1) if clipnorm is None else clip_scale(squared, clipnorm)
    iteration = None
    if loss_scale is not None:
        iteration = loss_scale.iteration(step)
        finite = bool(np.isfinite(squared))
        loss_scale.after(finite)
        scale = scale if finite else SKIP
    for channel in channels:
        with timeline.span(f"{getattr(channel, 'phase', 'sync')} release", step=step):
            channel.release(step, scale, iteration)
