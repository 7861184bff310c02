"""Each worker's random-layer stream (``autosync.runtime.random_seeds``): worker 0 keeps the seed's
state, the others get distinct, reproducible seed words that fit every dtype Keras keeps them in."""
from __future__ import annotations

import numpy as np

from autosync.runtime.random_seeds import worker_seed, worker_state


def test_worker_zero_keeps_the_seed_and_the_others_get_distinct_reproducible_words():
    for dtype in ("int64", "int32", "uint32"):
        initial = np.array([144272510, 3], dtype=dtype)
        states = [worker_state(initial, k) for k in range(64)]
        assert np.array_equal(states[0], initial) and states[0] is not initial
        assert len({int(s[0]) for s in states}) == 64   # a stream per worker
        assert all(s.dtype == initial.dtype and int(s[1]) == 3 for s in states)   # the counter kept
        assert all(0 < int(s[0]) < 2 ** 31 for s in states)
        assert all(np.array_equal(a, worker_state(initial, k)) for k, a in enumerate(states))
    # another seed, other words: worker k's stream is not one fixed seed whatever the model's
    assert worker_state(np.array([5, 0]), 1)[0] != worker_state(np.array([6, 0]), 1)[0]


def test_each_worker_draws_its_data_under_a_seed_of_its_own():
    seeds = [worker_seed(11, k) for k in range(64)]
    assert seeds[0] == 11 and len(set(seeds)) == 64 and all(0 < s < 2 ** 31 for s in seeds)
    assert seeds == [worker_seed(11, k) for k in range(64)]
    # not the random layers' words: data and masks are separate streams
    assert seeds[1] != int(worker_state(np.array([11, 0]), 1)[0])
