"""Where workers go on in the data after a restore onto another number of workers
(``session_state.resized_position``), checked against the global stream that interleaved parts
make (worker i of n takes batches i, i + n, i + 2n, ...: ``tf.data.Dataset.shard(n, i)``)."""
from __future__ import annotations

import itertools

import pytest

from autosync.runtime.session_state import resized_position


def drawn(workers: int, start: int, count: int) -> list[int]:
    """Global batch numbers ``workers`` workers draw, each ``count`` from ``start`` in its part."""
    return [k * workers + i for i in range(workers) for k in range(start, start + count)]


@pytest.mark.parametrize("before, after", [(n, m) for n, m in itertools.product(range(1, 6), repeat=2) if n != m])
def test_no_batch_is_skipped_and_fewer_than_one_per_worker_repeated(before, after):
    for position in range(0, 13):
        seen = drawn(before, 0, position)
        start = resized_position(position, before, after)
        following = drawn(after, start, 4)
        # every batch before the first one drawn after the restore was drawn before it: none skipped
        assert set(range(min(following))) <= set(seen), (position, start)
        repeated = set(seen) & set(following)
        assert len(repeated) < after or not repeated, (position, start, sorted(repeated))
        if position * before % after == 0:   # exactly the global stream's next batch
            assert min(following) == position * before and not repeated


def test_two_workers_at_3_go_on_as_one_at_6_and_one_at_9_as_two_at_4():
    """(Going on at the same position, the rule before, repeated 3 batches and skipped 9 here.)"""
    assert resized_position(3, 2, 1) == 6 and resized_position(9, 1, 2) == 4 and resized_position(0, 3, 2) == 0
