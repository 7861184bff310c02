"""The zoo's synthetic data has structure its models learn (``autosync.models.batches``): the
chance-level loss of each model (``autosync.models.chance``), determinism per (seed, worker), and,
in-process with each model's own loss and optimizer, its loss falling clearly below chance.

``benchmarks/zoo_learnability.py`` measures the issue's figure (below 70 % of chance within 500
steps, with the runtime on ``local``); this test holds each model to a cheaper bar so CI stays
short: the smoothed loss below 85 % of chance within a per-model step budget.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np
import pytest

from autosync.models import batches as B
from autosync.models import zoo
from autosync.models.chance import chance_loss

NAMES = ("resnet50", "vgg16", "bert", "lm1b", "ncf", "dlrm")
# steps within which each small model's smoothed loss falls below BAR x chance (measured in-process
# under load: resnet50 32, vgg16 82, bert 44, lm1b 156, ncf 71, dlrm 58 steps)
BUDGET = {"ncf": 150, "dlrm": 160, "lm1b": 250, "bert": 60, "resnet50": 80, "vgg16": 200}
BAR = 0.85
SMOOTH = 20


def _take(md, worker, workers, n):
    return list(itertools.islice(md.dataset_fn(worker, workers), n))


def _flat(batch):
    x, y = batch
    xs = x if isinstance(x, tuple) else (x,)
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in (*xs, y)])


@pytest.mark.parametrize("name", NAMES)
def test_streams_repeat_per_seed_and_worker_and_differ_between_workers(name):
    md = zoo.get_model_def(name)
    a, b = _take(md, 0, 2, 3), _take(md, 0, 2, 3)
    assert all(np.array_equal(_flat(x), _flat(y)) for x, y in zip(a, b))
    other = _take(md, 1, 2, 3)
    assert not any(np.array_equal(_flat(x), _flat(y)) for x, y in zip(a, other))
    x, y = a[0]
    assert len(y) == md.batch_size


def _class_means(md, worker, workers, batches=10):
    """Per class, the mean image averaged over each pattern cell: the class pattern, noise averaged out."""
    xs, ys = zip(*_take(md, worker, workers, batches))
    x, y = np.concatenate(xs), np.concatenate(ys)
    g, side = B.PATTERN_CELLS, x.shape[1] // B.PATTERN_CELLS
    cells = x.reshape(len(x), g, side, g, side, 3).mean(axis=(2, 4)).reshape(len(x), -1)
    return np.stack([cells[y == c].mean(axis=0) for c in range(md.dataset_fn.keywords["classes"])])


def _successors(md, worker, workers, tokens=range(5), batches=20):
    """The most frequent next token after each of ``tokens`` in a worker's text."""
    text = np.concatenate([x[0] for x, _ in _take(md, worker, workers, batches)])
    prev, nxt = text[:, :-1].ravel(), text[:, 1:].ravel()
    return [int(np.bincount(nxt[prev == t]).argmax()) for t in tokens]


def test_every_worker_samples_the_same_task_and_the_seed_picks_it():
    """The teacher depends on the seed alone: the class patterns and the text's successors one
    worker sees are those another worker sees; another seed has other ones."""
    images = zoo.get_model_def("vgg16")
    a, b = _class_means(images, 0, 2), _class_means(images, 1, 2)
    corr = np.corrcoef(a, b)[:len(a), len(a):]
    assert np.diag(corr).min() > 0.8, np.diag(corr)
    assert np.abs(corr[~np.eye(len(a), dtype=bool)]).mean() < 0.3
    text = zoo.get_model_def("lm1b")
    first = _successors(text, 0, 2)
    assert _successors(text, 1, 2) == first
    other_seed = dataclasses.replace(text, dataset_fn=functools.partial(text.dataset_fn, seed=1))
    assert sum(x != y for x, y in zip(_successors(other_seed, 0, 2), first)) >= 3


def test_chance_levels():
    for name in ("resnet50", "vgg16"):
        assert chance_loss(zoo.get_model_def(name)) == pytest.approx(math.log(10))
    p = B.CLICK_RATE
    for name in ("ncf", "dlrm"):   # the teachers' thresholds put CLICK_RATE of the examples above
        assert chance_loss(zoo.get_model_def(name), 100) == pytest.approx(-(p * math.log(p) + (1 - p) * math.log(1 - p)),
                                                                           abs=0.02)
    bert = zoo.get_model_def("bert")
    assert 1.0 < chance_loss(bert, 50) < math.log(bert.dataset_fn.keywords["vocab"])


def test_the_text_token_law_is_the_streams():
    """``markov_marginals`` (what the text models' chance levels rest on) matches the token
    frequencies of the stream at each position, to within sampling error."""
    md = zoo.get_model_def("bert")
    vocab, seq_len = md.dataset_fn.keywords["vocab"], md.dataset_fn.keywords["seq_len"]
    text = np.concatenate([y for _, y in _take(md, 0, 1, 200)])   # 3,200 sequences
    law = B.markov_marginals(vocab, seq_len, seed=0)
    assert np.allclose(law.sum(axis=1), 1.0)
    for j in (0, 1, 5, seq_len - 1):
        top = np.argsort(law[j])[::-1][:20]
        seen = np.bincount(text[:, j], minlength=vocab)[top] / len(text)
        sigma = np.sqrt(law[j, top] * (1 - law[j, top]) / len(text))
        assert np.all(np.abs(seen - law[j, top]) < 5 * sigma + 1e-3), (j, seen, law[j, top])
    # the positions differ (position 0 is plain Zipf-like, later ones carry the successors)
    assert np.abs(law[0] - law[5]).sum() > 0.1


def test_click_logs_draw_each_tables_ids_in_turn():
    """The click-log stream's ids are one Zipf-like draw per table, table after table, from the
    worker's generator: drawn for every table at once, the same stream bit for bit."""
    sizes, batch, dense = (7, 1000, 3, 50_000), 16, 5
    stream = B.click_log_batches(1, 2, dense_features=dense, table_sizes=sizes, batch_size=batch, seed=3)
    r = B.worker_rng(3, 1, 2)
    for (x, c), _ in itertools.islice(stream, 3):
        want_dense = np.log1p(r.lognormal(1.0, 1.0, size=(batch, dense))).astype(np.float32)
        want = np.stack([B.zipf_ids(r, t, (batch,)) for t in sizes], axis=1)
        np.testing.assert_array_equal(x, want_dense)
        assert c.dtype == want.dtype and c.flags.c_contiguous
        np.testing.assert_array_equal(c, want)
        assert all(0 <= c[:, j].min() and c[:, j].max() < t for j, t in enumerate(sizes))


def test_teacher_tables_give_the_hashed_parameters_bit_for_bit(monkeypatch):
    """The recommenders' teachers look a small vocabulary's parameters up in tables hashed once
    (``teacher_table``): the scores, and so the clicks, are exactly those of hashing each batch's
    ids; a vocabulary over ``TABLE_MAX_VALUES`` is hashed as before, and a table is made once."""
    r = np.random.default_rng(5)
    users, items = r.integers(0, 6040, 4000).astype(np.int32), B.zipf_ids(r, 3706, 4000)
    hashed = B.interaction_score(users, items, seed=2)
    np.testing.assert_array_equal(B.interaction_score(users, items, seed=2, vocab=(6040, 3706)), hashed)
    sizes = (3, 1460, 20_000, 5)
    cats = np.stack([B.zipf_ids(r, n, 3000) for n in sizes], axis=1)
    dense = r.random((3000, 13))
    want = B.click_score(dense, cats, seed=4)
    np.testing.assert_array_equal(B.click_score(dense, cats, seed=4, table_sizes=sizes), want)
    made = len(B._TABLES)
    B.click_score(dense, cats, seed=4, table_sizes=sizes)
    assert len(B._TABLES) == made   # looked up, not made again
    monkeypatch.setattr(B, "TABLE_MAX_VALUES", 1000)   # only the 3- and 5-id tables fit
    np.testing.assert_array_equal(B.click_score(dense, cats, seed=4, table_sizes=sizes), want)
    np.testing.assert_array_equal(B.interaction_score(users, items, seed=2, vocab=(6040, 3706)), hashed)
    assert B.teacher_table(4, 7, 1001) is None and B.teacher_table(4, 7, 1000).shape == (1000,)
    with pytest.raises(ValueError):
        B.teacher_table(4, 7, 1000)[0] = 1.0   # shared by every stream of the process: read-only


def test_the_recommender_streams_are_the_hashed_teachers_clicks():
    """Each click of the ncf and dlrm streams is the hashed teacher's score over its threshold."""
    for name in ("ncf", "dlrm"):
        md = zoo.get_model_def(name)
        kwargs = md.dataset_fn.keywords
        seed = kwargs.get("seed", 0)
        for (x, y) in _take(md, 1, 2, 3):
            if name == "ncf":
                score = B.interaction_score(x[0], x[1], seed)
                threshold = B._quantile_threshold(lambda r, n: B.interaction_score(
                    r.integers(0, kwargs["users"], size=n), B.zipf_ids(r, kwargs["items"], n), seed), seed)
            else:
                score = B.click_score(x[0], x[1], seed)
                sizes = kwargs["table_sizes"]

                def draw(r, n):
                    d = np.log1p(r.lognormal(1.0, 1.0, size=(n, kwargs["dense_features"]))).astype(np.float32)
                    u = r.random((len(sizes), n))
                    return d, np.ascontiguousarray(B.zipf_from_uniform(u, np.asarray(sizes, np.int64)[:, None]).T)
                threshold = B._quantile_threshold(lambda r, n: B.click_score(*draw(r, n), seed), seed)
            np.testing.assert_array_equal(y, (score > threshold).astype(np.float32))


def test_the_full_size_streams_build_no_tables():
    """A full-size vocabulary (lm1b's 800k, Criteo's tables) costs nothing to set up: the teachers'
    parameters are hashes, so the first batch comes at once."""
    import time

    for name in ("lm1b?size=full", "dlrm?size=full"):
        t0 = time.perf_counter()
        _take(zoo.get_model_def(name), 0, 1, 2)
        assert time.perf_counter() - t0 < 5.0


@pytest.mark.integration
@pytest.mark.parametrize("name", NAMES)
def test_each_small_model_learns_its_data(name):
    import keras

    from autosync.models.profile import train_step

    md = zoo.get_model_def(name)
    keras.utils.set_random_seed(md.seed)
    step = train_step(md.model_fn(), md.loss(), md.optimizer_fn())

    level, losses = chance_loss(md, 100), []
    data = md.batches(0, 1)
    for _ in range(BUDGET[name]):
        x, y = next(data)
        losses.append(float(step(list(x) if isinstance(x, tuple) else x, y)))
        if len(losses) >= SMOOTH and np.mean(losses[-SMOOTH:]) < BAR * level:
            break
    smoothed = float(np.mean(losses[-SMOOTH:]))
    assert smoothed < BAR * level, f"{name}: loss {smoothed:.3f} after {len(losses)} steps, chance {level:.3f}"
