"""The join of a step's pulled parts into one value per variable (``autosync.runtime.pulled``)."""
import numpy as np

from autosync.runtime.pulled import join_pulled


def test_whole_shards_join_on_their_axis_and_a_missing_shard_leaves_the_variable_out():
    a, b = np.arange(6.0).reshape(3, 2), np.arange(6.0, 10.0).reshape(2, 2)
    layout = [(2, 0), (2, 1), (1, 0)]
    parts = {(0, 0): a, (0, 1): b, (1, 0): a}   # variable 1 lacks its second shard, 2 all of it
    pulled = join_pulled(parts, layout, [5, 3, 4])
    assert sorted(pulled) == [0]
    np.testing.assert_array_equal(pulled[0], np.concatenate([a, b]))


def test_rows_of_one_shard_join_with_a_whole_shard_that_becomes_rows():
    rows = (np.array([1, 2]), np.array([[1.0], [2.0]]))
    whole = np.array([[30.0], [40.0]])          # shard 1 of a 4-row table: rows 2 and 3
    pulled = join_pulled({(0, 0): rows, (0, 1): whole}, [(2, 0)], [4])
    ids, values = pulled[0]
    np.testing.assert_array_equal(ids, [1, 2, 2, 3])
    np.testing.assert_array_equal(values[:, 0], [1.0, 2.0, 30.0, 40.0])


def test_one_shard_is_passed_through_as_received():
    only = np.ones((2, 2))
    rows = (np.array([0]), np.ones((1, 2)))
    pulled = join_pulled({(0, 0): only, (1, 0): rows}, [(1, 0), (1, 0)], [2, 3])
    assert pulled[0] is only and pulled[1] is rows
