"""Row-sparse parameter-server traffic (real Ray + TF): a worker pulls only the embedding rows its
step reads and pushes only the (deduplicated) rows it touched, yet trains exactly like one process.

The model has two row-sparse tables (one shared by two inputs) and a table tied to the output
layer, whose gradient is dense.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests import runtime_models as rm
from tests.runtime_helpers import PAIR
from strategy_space import PS, AllReduce, Strategy, VarConfig

pytestmark = pytest.mark.integration

STEPS = 4
OPTIMIZERS = {
    "sgd_momentum": ("sgd", {"learning_rate": 0.1, "momentum": 0.9}),
    "adam": ("adam", {"learning_rate": 0.05}),
    "adamw": ("adamw", {"learning_rate": 0.05, "weight_decay": 0.1}),
    "adagrad": ("adagrad", {"learning_rate": 0.2}),
}


def _spec(pool, md):
    from autosync.runtime.plan import model_spec_from_vars

    pool.ensure(md, PAIR.devices)
    return model_spec_from_vars(md.name, pool.description["variables"], md.batch_size)


def _mixed(spec, staleness: int = 0) -> Strategy:
    """Per shard: the shared table's shards on both PS nodes (one locally replicated) and in
    all-reduce; the tied table all-reduced; the rest on either PS."""
    ps = lambda node, **kw: PS(node, staleness=staleness, **kw)  # noqa: E731
    return Strategy((
        VarConfig("shared/embeddings", (ps("node1"), AllReduce(backend="objectstore"),
                                        ps("node0", local_replication=True))),
        VarConfig("other/embeddings", (ps("node0"), ps("node1"))),
        VarConfig("tied/embeddings", (AllReduce(backend="objectstore"),)),
        VarConfig("hidden/kernel", (ps("node1"),)),
        VarConfig("hidden/bias", (ps("node0", local_replication=True),)),
    ))


def _strategy(name: str, spec) -> Strategy:
    from strategy_space.builders import get_builder

    if name == "mixed":
        return _mixed(spec)
    options = {"partitioned_ps": {"min_partition_bytes": 1}, "parallax": {}, "ps": {}}[name]
    return get_builder(name, **options).build(spec, PAIR)


def _train(pool, md, strategy, steps=STEPS):
    from autosync.runtime.trainer import Trainer

    with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120) as trainer:
        history = trainer.fit(steps=steps, steps_per_call=2)
        return trainer, history, trainer.get_weights()


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("builder", ["ps", "partitioned_ps", "parallax", "mixed"])
def test_row_sparse_ps_equals_single_process(pool, builder, optimizer):
    kind, options = OPTIMIZERS[optimizer]
    md = rm.multi_model_def(kind, **options)
    spec = _spec(pool, md)
    assert [v.sparse for v in spec.variables] == [True, True, False, False, False]
    assert pool.description["row_pull"] == ["shared/embeddings", "other/embeddings"]
    assert pool.description["full_pull"] == {}
    strategy = _strategy(builder, spec)
    _, history, weights = _train(pool, md, strategy)
    expected = rm.reference_weights(md, num_workers=2, steps=STEPS)
    initial = rm.reference_weights(md, num_workers=2, steps=0)
    for got, want, var in zip(weights, expected, spec.variables):
        # repeated rows are summed on each worker before the PS adds the workers' sums: the
        # additions are reassociated, and Adam's m / sqrt(v) amplifies that rounding where slices
        # cancel (seen: 1.3e-6)
        assert np.allclose(got, want, rtol=1e-5, atol=5e-6), (builder, optimizer, var.name, np.abs(got - want).max())
    # the tables moved, including rows no step read (Adam's moments, weight decay, momentum)
    assert not np.allclose(weights[0], initial[0]) and not np.allclose(weights[2], initial[2])
    assert len(history.loss) == STEPS


def test_a_table_updated_ahead_trains_as_one_process(pool):
    """A table over ``AHEAD_MIN_BYTES`` with Adam on a PS of two workers: each step's first push
    starts its untouched rows' update ahead (``update_ahead``), and training equals one process."""
    from autosync.runtime.trainer import Trainer
    from autosync.runtime.update_ahead import AHEAD_MIN_BYTES
    from strategy_space.builders import get_builder

    vocab = 70_000
    md = rm.model_def("adam", vocab=vocab, learning_rate=0.05)
    spec = _spec(pool, md)
    assert spec.var("emb/embeddings").bytes >= AHEAD_MIN_BYTES
    with Trainer(md, get_builder("ps").build(spec, PAIR), PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=STEPS, steps_per_call=2)
        weights, stats = trainer.get_weights(), trainer.session.ps_stats()
    assert sum(s["ahead"] for s in stats.values()) >= 1
    for got, want in zip(weights, rm.reference_weights(md, num_workers=2, steps=STEPS)):
        assert np.allclose(got, want, rtol=1e-5, atol=5e-6), np.abs(got - want).max()


def test_staleness_2_row_pulls_converge(pool):
    md = rm.multi_model_def("adam", learning_rate=0.05)
    strategy = _mixed(_spec(pool, md), staleness=2)
    trainer, history, weights = _train(pool, md, strategy, steps=40)
    assert trainer.plan.staleness == 2
    first, last = np.mean(history.loss[:4]), np.mean(history.loss[-4:])
    assert last < 0.7 * first, (first, last)
    assert all(np.isfinite(w).all() for w in weights)


def test_bytes_per_step_are_rows_touched_times_width(pool):
    """Every variable on one PS: per step a worker receives exactly the rows its batch reads
    (plus the dense variables whole) and sends the ids it asks for (once: its push refers to
    them) and its deduplicated rows' values; nothing near the tables' size."""
    from autosync.runtime.runner import RayRunner
    from strategy_space.builders import get_builder

    md = rm.multi_model_def("sgd", learning_rate=0.1)
    spec = _spec(pool, md)
    runner = RayRunner(md, PAIR, warmup=0, steps=STEPS, pool=pool, trial_timeout_s=120)
    trial = runner.run([get_builder("ps").build(spec, PAIR)])[0]
    assert trial.status == "ok", trial.error
    moved = trial.meta["bytes_per_step_per_worker"]
    assert trial.meta["full_pull"] == {}
    (name, stats), = trial.meta["ps_stats"].items()  # one PS actor: every worker's push each step
    # every worker's push of each step, and of the untimed step that ends the measurement
    assert stats["pushes"] == 2 * (STEPS + 1) and stats["wait_s"] >= 0 and stats["apply_s"] > 0

    dense = sum(v.bytes for v in spec.variables if not v.sparse)
    width = rm.DIM * 4
    shared, other = [], []  # per worker and step, unique rows of each table
    for w in range(2):
        for x, _ in rm.multi_batches(w, 2)[:STEPS]:
            shared.append(len(np.unique(np.concatenate([x[0].ravel(), x[1].ravel()]))))
            other.append(len(np.unique(x[2])))
    rows = float(np.mean(shared) + np.mean(other))
    minimum = rows * width
    assert moved["bytes_received"] == pytest.approx(minimum + dense, rel=1e-9)
    # sent: the rows' values and, once, their ids (2 bytes in the 300-row table, 1 in the
    # 50-row one); no squares for SGD
    ids = 2 * np.mean(shared) + np.mean(other)
    assert moved["bytes_sent"] == pytest.approx(minimum + ids + dense, rel=1e-9)
    assert (moved["bytes_sent"] - dense) / minimum <= 1 + 2 / width
    tables = sum(v.bytes for v in spec.variables if v.sparse)
    assert moved["bytes_received"] - dense < 0.2 * tables
