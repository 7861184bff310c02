"""A worker's next batches, drawn on a thread of their own while its step computes and waits for
the network (what ``tf.data``'s ``prefetch`` and Keras' data adapters do for ``fit``).

A step's batch used to be drawn from ``dataset_fn`` at the start of the step, on its critical
path: the zoo's learnable data costs ncf-small's worker about half a millisecond a step there, and
a user's Python pipeline (decoding, augmenting) can cost much more. ``Prefetcher`` draws up to
``depth`` batches ahead on one thread, in order, so a step only takes what is ready; the batches
and their order are exactly the iterator's. An error the iterator raises is raised where the batch
it was drawing is taken, once the batches before it are taken.
"""
from __future__ import annotations

import queue
import threading

PREFETCH_BATCHES = 2   # batches drawn ahead: one for the next step, one for the step after (or accumulation)
_POLL_S = 0.1   # how often a full queue's producer checks whether it was closed
RESTART_WAIT_S = 1.0   # how long ``restart`` waits for the old thread to end


class Prefetcher:
    """An iterator over ``source``'s items, drawn ahead on a daemon thread.

    Args:
        source: the iterator to draw from (only the thread draws from it once it started).
        depth: how many items are drawn ahead at most.

    Attributes:
        ahead: items drawn but not yet taken (for tests and diagnostics).
    """

    def __init__(self, source, depth: int = PREFETCH_BATCHES):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._source = source
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._fill, name="autosync-prefetch", daemon=True)
        self._thread.start()

    @property
    def ahead(self) -> int:
        return self._queue.qsize()

    def _fill(self) -> None:
        while not self._closed.is_set():
            try:
                item = (True, next(self._source))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, StopIteration included
                item = (False, e)
            while not self._closed.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if not item[0]:
                return

    def drawing_frame(self):
        """The Python frame the drawing thread is in now (None once it ended): where a draw hangs."""
        import sys

        return sys._current_frames().get(self._thread.ident) if self._thread.is_alive() else None

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        ok, value = self._queue.get()
        if ok:
            return value
        self._done = True
        raise value

    def close(self, wait_s: float = 0.0) -> None:
        """Stop drawing (the thread ends within ``_POLL_S``, or when its current draw returns);
        wait for that up to ``wait_s``."""
        self._closed.set()
        self._done = True
        if wait_s > 0:
            while True:   # what was drawn is dropped: a producer waiting to put one ends at once
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._thread.join(wait_s)


def restart(old, source, depth: int = PREFETCH_BATCHES) -> Prefetcher:
    """A ``Prefetcher`` over ``source`` in place of ``old`` (closed if it is one, and its thread
    given up to a second to end: a draw it had under way would take from the process-wide random
    generators the new one starts from, ``random_seeds.seeded``)."""
    if isinstance(old, Prefetcher):
        old.close(wait_s=RESTART_WAIT_S)
    return Prefetcher(source, depth)
