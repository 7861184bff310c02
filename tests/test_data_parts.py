"""A worker that draws the batches of several data parts (``data_parts``: the global batch kept on
fewer workers), without Ray or TensorFlow: the order of the parts' batches, their own random
streams, which worker takes a lost worker's parts, and the positions a checkpoint keeps."""
from __future__ import annotations

import random

import numpy as np
import pytest

from autosync.runtime import data_parts
from strategy_space.errors import ConfigError


def _global_draws(tag: str):
    """A part's batches drawn from the process-wide generators, seeded where it starts (as
    ``random_seeds.seeded`` does for each part)."""
    seed = sum(map(ord, tag))
    random.seed(seed)
    np.random.seed(seed)
    while True:
        yield tag, round(random.random(), 12), float(np.random.normal())


def test_parts_take_turns_a_chunk_each_and_draw_as_they_would_alone():
    alone = {t: [next(s) for s in [_global_draws(t)] for _ in range(6)] for t in "ab"}
    mixed = data_parts.interleaved([_global_draws("a"), _global_draws("b")], chunk=2)
    got = [next(mixed) for _ in range(12)]
    assert [g[0] for g in got] == list("aabbaabbaabb")
    assert [g for g in got if g[0] == "a"] == alone["a"] and [g for g in got if g[0] == "b"] == alone["b"]


def test_the_generators_outside_are_left_as_they_were_and_the_first_ended_part_ends_it():
    np.random.seed(3)
    random.seed(3)
    want = np.random.normal(), random.random()
    np.random.seed(3)
    random.seed(3)
    mixed = data_parts.interleaved([iter([1, 2]), iter([10, 20, 30])], chunk=1)
    assert list(mixed) == [1, 10, 2, 20]
    assert (np.random.normal(), random.random()) == want


def test_a_lost_worker_s_parts_go_to_the_worker_left_that_holds_fewest():
    assert data_parts.assign(["a:0", "b:0", "c:0"], None, ["a:0", "c:0"]) == [(0, 1), (2,)]
    # a second loss: b's part went to a before; c's goes to d, which holds fewer
    assert data_parts.assign(["a:0", "c:0", "d:0"], [(0, 1), (2,), (3,)], ["a:0", "d:0"]) == [(0, 1), (2, 3)]
    assert data_parts.assign(["a:0", "b:0", "c:0", "d:0"], None, ["d:0"]) == [(0, 1, 2, 3)]
    with pytest.raises(ValueError, match="x:0 did not train before"):
        data_parts.assign(["a:0", "b:0"], None, ["a:0", "x:0"])


def test_each_part_s_position_is_its_worker_s():
    states = [{"position": 4, "parts": [[0, 2], 3]}, {"position": 4, "parts": [[1], 3]}]
    assert data_parts.part_positions(states) == (4, 4, 4)
    assert data_parts.part_positions([{"position": 2}, {"position": 3}]) == (2, 3)
    with pytest.raises(ValueError, match=r"data parts \[1\] are held by no worker"):
        data_parts.part_positions([{"position": 4, "parts": [[0, 2], 3]}])


def test_a_restore_onto_fewer_workers_deals_the_parts_and_onto_more_is_refused():
    assert data_parts.restored(4, 2, True) == [(0, 2), (1, 3)]
    assert data_parts.restored(3, 2, True) == [(0, 2), (1,)]
    assert data_parts.restored(4, 2, False) is None and data_parts.restored(2, 2, True) is None
    with pytest.raises(ConfigError, match="trained on 2 workers, fewer than the 3 here"):
        data_parts.restored(2, 3, True)
