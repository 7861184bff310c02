"""``autosync.runtime.prefetch``: a worker's batches drawn ahead on a thread, in order (no Ray, no
TensorFlow)."""
from __future__ import annotations

import threading
import time

import pytest

from autosync.runtime.prefetch import Prefetcher, restart


def _wait(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()


class Counting:
    """An endless iterator that counts its draws (and the threads they ran on)."""

    def __init__(self, fail_at=None):
        self.drawn, self.threads, self.fail_at = 0, set(), fail_at

    def __iter__(self):
        return self

    def __next__(self):
        if self.drawn == self.fail_at:
            raise ValueError(f"bad record {self.drawn}")
        self.drawn += 1
        self.threads.add(threading.current_thread().name)
        return self.drawn - 1


def test_the_items_in_order_drawn_ahead_on_a_thread_at_most_depth():
    src = Counting()
    p = Prefetcher(src, depth=2)
    assert _wait(lambda: src.drawn == 3)   # two queued, a third waiting to be queued
    time.sleep(0.05)
    assert src.drawn == 3 and p.ahead == 2
    assert [next(p) for _ in range(5)] == [0, 1, 2, 3, 4]
    assert _wait(lambda: p.ahead == 2) and src.threads == {"autosync-prefetch"}
    p.close()


def test_an_error_comes_where_its_item_would_and_ends_the_iterator():
    p = Prefetcher(Counting(fail_at=2), depth=4)
    assert next(p) == 0 and next(p) == 1
    with pytest.raises(ValueError, match="bad record 2"):
        next(p)
    with pytest.raises(StopIteration):
        next(p)


def test_a_finite_source_ends_the_iteration():
    assert list(Prefetcher(iter([1, 2, 3]))) == [1, 2, 3]


def test_closing_stops_the_drawing_and_restart_replaces_it():
    src = Counting()
    p = Prefetcher(src, depth=1)
    assert _wait(lambda: src.drawn == 2)
    p.close()
    assert _wait(lambda: not p._thread.is_alive(), timeout=2.0)
    assert src.drawn == 2
    with pytest.raises(StopIteration):
        next(p)
    fresh = Counting()
    q = restart(p, fresh)
    assert next(q) == 0 and q is not p
    r = restart(q, iter("ab"))
    assert _wait(lambda: not q._thread.is_alive(), timeout=2.0) and list(r) == ["a", "b"]
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(iter(()), depth=0)


def test_restart_ends_the_old_thread_before_the_new_one_draws(monkeypatch):
    """The new iterator may reseed the process-wide generators (``random_seeds.seeded``): a draw
    of the old thread after that would take from the new stream. ``restart`` ends it first, at
    once when it waits with a full queue, else within its current draw (a second at most)."""
    import autosync.runtime.prefetch as prefetch

    monkeypatch.setattr(prefetch, "_POLL_S", 30.0)   # a closed producer would notice only after 30 s
    src = Counting()
    p = Prefetcher(src, depth=2)
    assert _wait(lambda: p.ahead == 2 and src.drawn == 3)   # two queued, a third waiting to be put
    q = restart(p, iter("xy"))
    assert not p._thread.is_alive()   # ended by the drained queue, not by its poll
    assert list(q) == ["x", "y"] and src.drawn == 3

    class Slow(Counting):
        def __next__(self):
            time.sleep(0.3)
            return super().__next__()

    slow = Slow()
    p = Prefetcher(slow, depth=1)
    time.sleep(0.05)   # its first draw under way
    restart(p, iter(()))
    assert not p._thread.is_alive()
