"""Updating ahead (``autosync.runtime.update_ahead``): a row-updated variable's step computed before
its gradient is known, then finished on the touched rows, equals the whole update bit for bit;
one that no longer holds is dropped; a parameter server starts it on a step's first push."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from autosync.runtime.optimizers import make_optimizer
from autosync.runtime.ps_shard import ParameterServerShard


@pytest.fixture(autouse=True)
def small_tables_too(monkeypatch):
    """These tests' tables are small: updated ahead all the same (``AHEAD_MIN_BYTES``), every
    step (``AHEAD_PROBE`` 1: these tests are not about lateness)."""
    from autosync.runtime import update_ahead

    monkeypatch.setattr(update_ahead, "AHEAD_MIN_BYTES", 0)
    monkeypatch.setattr(update_ahead, "AHEAD_PROBE", 1)


CONFIGS = {
    "adam": {"class": "Adam", "learning_rate": 0.01},
    "adamw": {"class": "AdamW", "learning_rate": 0.01, "weight_decay": 0.004},
    "amsgrad": {"class": "Adam", "learning_rate": 0.01, "amsgrad": True},
    "momentum": {"class": "SGD", "learning_rate": 0.1, "momentum": 0.9},
    "nesterov": {"class": "SGD", "learning_rate": 0.1, "momentum": 0.9, "nesterov": True},
}


def _grad(rng, step):
    rows = rng.integers(0, 50, size=12)   # repeated rows among them
    return rows, rng.standard_normal((12, 4)).astype(np.float32), None


def _run(config, steps, ahead, disturb=None):
    rng = np.random.default_rng(3)
    params = {"emb": rng.standard_normal((50, 4)).astype(np.float32),
              "w": rng.standard_normal(4).astype(np.float32)}
    o = make_optimizer(config)
    for k, v in params.items():
        o.add_variable(k, v)
    for step in range(steps):
        if ahead:
            o.update_ahead(step, params, ["emb"])
            o.wait_ahead()   # the pushes take longer than the update ahead
        if disturb is not None:
            disturb(step, params, o)
        grads = {"emb": _grad(rng, step), "w": rng.standard_normal(4).astype(np.float32)}
        o.apply(step, params, grads)
    return params, o, o.ahead   # the updates finished from an update ahead


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_an_update_computed_ahead_equals_the_whole_update_bit_for_bit(name):
    whole, o_whole, _ = _run(CONFIGS[name], 6, ahead=False)
    early, o_early, used = _run(CONFIGS[name], 6, ahead=True)
    assert used == 6   # every step was finished from its update ahead
    for k in whole:   # bit for bit (signed zeros included)
        assert early[k].tobytes() == whole[k].tobytes()
    for k in o_whole.slots:
        for slot in o_whole.slots[k]:
            assert o_early.slots[k][slot].tobytes() == o_whole.slots[k][slot].tobytes()


def test_readers_of_the_value_before_the_step_keep_it():
    o = make_optimizer(CONFIGS["adam"])
    params = {"emb": np.ones((8, 2), np.float32)}
    o.add_variable("emb", params["emb"])
    seen = o.snapshot(params, "emb")
    o.update_ahead(0, params, ["emb"])
    o.apply(0, params, {"emb": (np.array([1]), np.ones((1, 2), np.float32), None)})
    assert np.all(seen == 1) and not np.all(params["emb"] == 1)


def test_an_update_ahead_that_no_longer_holds_is_dropped():
    def replace_value(step, params, o):   # e.g. a checkpoint loaded in between
        if step == 2:
            params["emb"] = params["emb"] + np.float32(1)

    def another_step(step, params, o):   # asked ahead for a step other than the one applied
        if "emb" in o._ahead:
            o._ahead["emb"] = (step + 1,) + o._ahead["emb"][1:]

    for disturb, expect_used in ((replace_value, 3), (another_step, 0)):
        reference, _, _ = _run(CONFIGS["adam"], 4, ahead=False, disturb=disturb)
        got, o, used = _run(CONFIGS["adam"], 4, ahead=True, disturb=disturb)
        assert used == expect_used and not o._ahead
        np.testing.assert_array_equal(got["emb"], reference["emb"])


def test_a_small_table_is_updated_whole(monkeypatch):
    from autosync.runtime import update_ahead

    monkeypatch.setattr(update_ahead, "AHEAD_MIN_BYTES", 8 * 2 * 4 + 1)   # the table's bytes, plus one
    o = make_optimizer(CONFIGS["adam"])
    params = {"emb": np.ones((8, 2), np.float32)}
    o.add_variable("emb", params["emb"])
    o.update_ahead(0, params, ["emb"])
    assert not o._ahead


def test_rules_that_leave_untouched_rows_alone_compute_nothing_ahead():
    for config in ({"class": "Adagrad", "learning_rate": 0.1}, {"class": "SGD", "learning_rate": 0.1}):
        o = make_optimizer(config)
        params = {"emb": np.ones((8, 2), np.float32)}
        o.add_variable("emb", params["emb"])
        o.update_ahead(0, params, ["emb"])
        assert not o._ahead


def test_a_parameter_server_starts_the_update_ahead_on_a_steps_first_push():
    rng = np.random.default_rng(0)
    values = {(0, 0): rng.standard_normal((30, 3)).astype(np.float32), (1, 0): rng.standard_normal(3).astype(np.float32)}
    grads = [{(0, 0): (np.array([2, 5, 2]), rng.standard_normal((3, 3)).astype(np.float32)),
              (1, 0): rng.standard_normal(3).astype(np.float32)} for _ in range(2)]

    def run(ahead: bool):
        ps = ParameterServerShard("ps@x", {k: v.copy() for k, v in values.items()}, [(0, 0)], [], CONFIGS["adam"],
                                  num_workers=2, sync=True)
        if not ahead:
            ps.optimizer.update_ahead = lambda *a: None
        started = []

        async def go():
            for step in range(3):
                await ps.push(0, step, grads[0])
                started.append((0, 0) in ps.optimizer._ahead)
                _wait_ahead(ps)
                await ps.push(1, step, grads[1])
            return await ps.values()
        return asyncio.run(go()), started

    (got, started), (want, _) = run(True), run(False)
    assert started == [True] * 3   # started by worker 0's push, finished by worker 1's
    for k in values:
        np.testing.assert_array_equal(got[k], want[k])


def _two_worker_ps(config=CONFIGS["adam"]):
    rng = np.random.default_rng(1)
    ps = ParameterServerShard("ps@x", {(0, 0): rng.standard_normal((40, 3)).astype(np.float32)}, [(0, 0)], [],
                              config, num_workers=2, sync=True)
    return ps, rng


def _wait_ahead(ps):
    """The second worker's push comes after the update ahead is done (as across a network)."""
    for pending in getattr(ps.optimizer, "_ahead", {}).values():
        pending[3].result()


def _step(ps, rng, step):
    async def go():
        for w in range(2):
            await ps.push(w, step, {(0, 0): (rng.integers(0, 40, 4), rng.standard_normal((4, 3)).astype(np.float32))})
            _wait_ahead(ps)
    asyncio.run(go())


def test_a_variable_updated_ahead_takes_turns_between_two_sets_of_arrays():
    ps, rng = _two_worker_ps()
    arrays = []
    for step in range(6):
        _step(ps, rng, step)
        arrays.append(id(ps.params[(0, 0)]))
    assert len(set(arrays[1:])) == 2 and arrays[1] == arrays[3] == arrays[5]   # no new array after the second
    assert ps.optimizer.copies == 2
    # a pull that still reads the value of the step before: the next update ahead writes new arrays
    held = asyncio.run(ps.pull(6))[1][(0, 0)]
    kept = held.copy()
    _step(ps, rng, 6)
    _step(ps, rng, 7)
    np.testing.assert_array_equal(held, kept)
    assert ps.optimizer.copies == 3


def test_a_variable_too_large_to_double_is_updated_whole(monkeypatch):
    from autosync.runtime import update_ahead

    monkeypatch.setattr(update_ahead, "AHEAD_MAX_BYTES", 40 * 3 * 4 * 3 - 1)   # value + two Adam slots, less a byte
    ps, rng = _two_worker_ps()
    tables = []
    for step in range(3):
        _step(ps, rng, step)
        assert not ps.optimizer._ahead
        tables.append(ps.params[(0, 0)])
    assert tables[1] is tables[2] and ps.optimizer.copies == 1   # the received value copied once, then in place


def test_updates_ahead_that_keep_their_step_waiting_are_tried_only_every_few_steps(monkeypatch):
    import time

    from autosync.runtime import update_ahead

    monkeypatch.setattr(update_ahead, "AHEAD_PROBE", 8)
    o = make_optimizer(CONFIGS["adam"])
    # 6.4 MB: its update ahead takes milliseconds, far more than fetching a finished one's result
    params = {"emb": np.ones((400_000, 4), np.float32)}
    o.add_variable("emb", params["emb"])
    slow = o._zero_step
    # a wait under AHEAD_LATE_S (a loaded machine's hiccup) is never late: raised above the whole
    # update ahead, every step tries, though each waits for all of it
    monkeypatch.setattr(update_ahead, "AHEAD_LATE_S", 10.0)
    for step in range(3):
        o.update_ahead(step, params, ["emb"])
        assert "emb" in o._ahead
        o.apply(step, params, {"emb": (np.array([1]), np.ones((1, 4), np.float32), None)})
    monkeypatch.setattr(update_ahead, "AHEAD_LATE_S", 1e-3)
    o._zero_step = lambda *a: (time.sleep(0.05), slow(*a))[1]   # the last push comes before it is done
    tried = []
    for step in range(3, 2 * update_ahead.AHEAD_PROBE + 1):
        o.update_ahead(step, params, ["emb"])
        tried.append("emb" in o._ahead)
        o.apply(step, params, {"emb": (np.array([1]), np.ones((1, 4), np.float32), None)})
    tried = [True] * 3 + tried
    assert [s for s, t in enumerate(tried) if t] == [0, 1, 2, 3, update_ahead.AHEAD_PROBE, 2 * update_ahead.AHEAD_PROBE]
    o._zero_step = slow   # on time again, from the next step that tries: every step
    probe = 3 * update_ahead.AHEAD_PROBE
    for step in range(2 * update_ahead.AHEAD_PROBE + 1, probe + 3):
        o.update_ahead(step, params, ["emb"])
        tried.append("emb" in o._ahead)
        if tried[-1]:
            o._ahead["emb"][3].result()
        o.apply(step, params, {"emb": (np.array([1]), np.ones((1, 4), np.float32), None)})
    assert [s for s, t in enumerate(tried) if t][-4:] == [2 * update_ahead.AHEAD_PROBE, probe, probe + 1, probe + 2]


def test_an_update_ahead_that_failed_leaves_the_whole_update_to_run():
    reference, _, _ = _run(CONFIGS["adam"], 3, ahead=False)

    def fail_once(step, params, o):
        if step == 1:
            o._ahead["emb"][3].result = lambda: (_ for _ in ()).throw(MemoryError("no room for a second table"))

    got, o, used = _run(CONFIGS["adam"], 3, ahead=True, disturb=fail_once)
    assert used == 2
    np.testing.assert_array_equal(got["emb"], reference["emb"])


def _tables(rng):
    """Sparse gradients of five tables: three alike, one wider, one in float64, one with the
    sender's square sums; rows repeat, one table's ids in another integer dtype."""
    grads = {}
    for t, (rows, width, dtype, draws) in enumerate([(50, 4, np.float32, 30), (7, 4, np.float32, 40),
                                                      (300, 4, np.float32, 5), (50, 8, np.float32, 20),
                                                      (50, 4, np.float64, 20), (90, 4, np.float32, 25)]):
        ids = rng.integers(0, rows, draws).astype(np.uint16 if t == 2 else np.int64)
        values = rng.standard_normal((draws, width)).astype(dtype)
        squares = np.square(values) * np.float32(1.5) if t == 5 else None
        grads[f"t{t}"] = (ids, values, squares)
    return grads


def test_row_sums_of_many_tables_at_once_are_each_tables_own_bit_for_bit():
    """Against the plain rule per table: its distinct rows, each from zero plus its slices in
    order (``np.add.at``), the squares likewise (the sender's where given)."""
    from autosync.runtime.update_ahead import row_sums_many

    grads = _tables(np.random.default_rng(5))
    dtypes = {k: g[1].dtype for k, g in grads.items()}
    for squares in (True, False):
        many = row_sums_many(grads, dtypes, squares)
        assert set(many) == set(grads)
        for key, (ids, values, given) in grads.items():
            rows, inverse = np.unique(ids, return_inverse=True)
            sums, square_sums = np.zeros((len(rows),) + values.shape[1:], values.dtype), None
            np.add.at(sums, inverse, values)
            if squares:
                square_sums = np.zeros_like(sums)
                np.add.at(square_sums, inverse, np.square(values) if given is None else given)
            got = many[key]
            assert got[0].dtype == ids.dtype and got[0].tolist() == rows.tolist()
            assert got[1].tobytes() == sums.tobytes()
            assert (got[2] is None) == (square_sums is None)
            assert square_sums is None or got[2].tobytes() == square_sums.tobytes()


@pytest.mark.parametrize("name", ["adam", "adamw", "adagrad"])
def test_a_step_of_many_tables_at_once_is_each_tables_own_step_bit_for_bit(name):
    """One ``apply`` of every table's gradient (their rows summed together) and one ``apply`` per
    table give the same values and slots, signed zeros included."""
    config = CONFIGS.get(name, {"class": "Adagrad", "learning_rate": 0.1})
    rng = np.random.default_rng(11)
    grads = _tables(rng)
    start = {k: rng.standard_normal((int(max(g[0].max() + 1, 300)), g[1].shape[1])).astype(g[1].dtype)
             for k, g in grads.items()}
    runs = []
    for together in (True, False):
        params = {k: v.copy() for k, v in start.items()}
        o = make_optimizer(config)
        for k, v in params.items():
            o.add_variable(k, v)
        for step in range(3):
            if together:
                o.apply(step, params, grads)
            else:
                for k, g in grads.items():
                    o.apply(step, params, {k: g})
        runs.append((params, o))
    (a, oa), (b, ob) = runs
    for k in a:
        assert a[k].tobytes() == b[k].tobytes()
        for slot in oa.slots[k]:
            assert oa.slots[k][slot].tobytes() == ob.slots[k][slot].tobytes()


BLOCKED = {**CONFIGS, "sgd": {"class": "SGD", "learning_rate": 0.1},
           "adagrad": {"class": "Adagrad", "learning_rate": 0.1}}


def test_only_rules_of_many_passes_run_in_blocks():
    assert [n for n, c in sorted(BLOCKED.items()) if make_optimizer(c).blocks] == ["adagrad", "adam", "adamw", "amsgrad"]


@pytest.mark.parametrize("ahead", [False, True], ids=["whole", "ahead"])
@pytest.mark.parametrize("name", sorted(BLOCKED))
def test_an_update_in_blocks_equals_the_update_in_one_pass_bit_for_bit(name, ahead, monkeypatch):
    """``_update_blocked`` with blocks of one value (the table's 50 x 4 in 50 blocks of a row, the
    sparse rows cut between them; the dense 4 values one by one) gives every bit of one pass, on
    the table's sparse steps and on a dense gradient, updated ahead or not."""
    from autosync.runtime import blocks, optimizers

    calls = []
    real = optimizers.NumpyOptimizer._update_blocked

    def counted(self, *args, **kw):
        calls.append(args[2].size)
        return real(self, *args, **kw)

    monkeypatch.setattr(optimizers.NumpyOptimizer, "_update_blocked", counted)
    monkeypatch.setattr(blocks, "BLOCK_VALUES", 1 << 30)
    one, o_one, _ = _run(BLOCKED[name], 5, ahead)
    monkeypatch.setattr(blocks, "BLOCK_VALUES", 1)
    blocks, o_blocks, _ = _run(BLOCKED[name], 5, ahead)
    for k in one:
        assert blocks[k].tobytes() == one[k].tobytes(), k
        for slot in o_one.slots[k]:
            assert o_blocks.slots[k][slot].tobytes() == o_one.slots[k][slot].tobytes(), (k, slot)
    if name not in ("sgd", "momentum", "nesterov"):   # SGD: one or two passes, never in blocks
        assert 200 in calls   # the table went through the blocked update


def test_blocks_cut_a_dense_gradient_and_a_tables_rows(monkeypatch):
    from autosync.runtime import blocks

    monkeypatch.setattr(blocks, "BLOCK_VALUES", 8)
    o = make_optimizer(CONFIGS["adam"])
    seen = []
    o._update = lambda it, key, var, rows, g, g2, slots=None: seen.append(
        (var.shape, None if rows is None else rows.tolist(), len(g), sorted(slots)))
    var = np.zeros((10, 4), np.float32)
    o.add_variable("t", var)
    o._update_blocked(0, "t", var, np.array([0, 1, 5, 9]), np.ones((4, 4), np.float32),
                      np.ones((4, 4), np.float32))
    assert seen == [((2, 4), [0, 1], 2, ["m", "v"]), ((2, 4), [], 0, ["m", "v"]), ((2, 4), [1], 1, ["m", "v"]),
                    ((2, 4), [], 0, ["m", "v"]), ((2, 4), [1], 1, ["m", "v"])]
    seen.clear()
    o._update_blocked(0, "t", var, None, np.ones((10, 4), np.float32), np.ones((10, 4), np.float32))
    assert [s[0] for s in seen] == [(8,)] * 5
    seen.clear()
    small = np.zeros((4, 4), np.float32)   # not above two blocks: one pass
    o.add_variable("s", small)
    o._update_blocked(0, "s", small, None, np.ones((4, 4), np.float32), np.ones((4, 4), np.float32))
    assert [s[0] for s in seen] == [(4, 4)]
