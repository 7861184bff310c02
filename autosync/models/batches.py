"""Synthetic, deterministic data shards for the zoo models (no downloads).

Every generator is a module-level function so that ``functools.partial`` of it pickles; each
worker draws from its own seeded generator, so shards differ between workers and repeat exactly.
"""
from __future__ import annotations

import numpy as np

# Criteo Kaggle display-advertising categorical cardinalities, as used by DLRM's Kaggle setup
CRITEO_KAGGLE_TABLES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
CRITEO_DENSE_FEATURES = 13

# number of distinct batches in one pass of a zoo dataset; ModelDef.batches cycles it
BATCHES_PER_EPOCH = 8


def worker_rng(seed: int, worker_index: int, num_workers: int) -> np.random.Generator:
    """A generator seeded by (seed, worker index, worker count)."""
    if not 0 <= worker_index < num_workers:
        raise ValueError(f"worker_index must be in [0, {num_workers}), got {worker_index}")
    return np.random.default_rng([seed, worker_index, num_workers])


def zipf_ids(rng: np.random.Generator, vocab: int, size) -> np.ndarray:
    """Ids in [0, vocab) from a log-uniform (Zipf-like) law, as in word and item frequencies:
    P(id) is proportional to log((id + 2) / (id + 1))."""
    u = rng.random(size)
    ids = np.floor(np.exp(u * np.log(vocab + 1.0))).astype(np.int64) - 1
    return np.clip(ids, 0, vocab - 1).astype(np.int32)


def image_batches(worker_index: int, num_workers: int, *, image_size: int, classes: int,
                  batch_size: int, seed: int = 0):
    """Random images in [0, 1) and integer class labels."""
    rng = worker_rng(seed, worker_index, num_workers)
    for _ in range(BATCHES_PER_EPOCH):
        x = rng.random((batch_size, image_size, image_size, 3), dtype=np.float32)
        y = rng.integers(0, classes, size=(batch_size,), dtype=np.int32)
        yield x, y


def masked_lm_batches(worker_index: int, num_workers: int, *, vocab: int, seq_len: int,
                      batch_size: int, seed: int = 0):
    """BERT-style inputs ``(token_ids, segment_ids)`` and a target token at every position."""
    rng = worker_rng(seed, worker_index, num_workers)
    for _ in range(BATCHES_PER_EPOCH):
        tokens = zipf_ids(rng, vocab, (batch_size, seq_len))
        split = rng.integers(1, seq_len, size=(batch_size, 1))
        segments = (np.arange(seq_len)[None, :] >= split).astype(np.int32)
        targets = zipf_ids(rng, vocab, (batch_size, seq_len))
        yield (tokens, segments), targets


def language_model_batches(worker_index: int, num_workers: int, *, vocab: int, seq_len: int,
                           batch_size: int, seed: int = 0):
    """Token windows: inputs ``(tokens, next_tokens)``, targets unused zeros (the model returns
    its per-token sampled-softmax loss)."""
    rng = worker_rng(seed, worker_index, num_workers)
    for _ in range(BATCHES_PER_EPOCH):
        window = zipf_ids(rng, vocab, (batch_size, seq_len + 1))
        yield (window[:, :-1], window[:, 1:]), np.zeros((batch_size, seq_len), np.float32)


def interaction_batches(worker_index: int, num_workers: int, *, users: int, items: int,
                        batch_size: int, seed: int = 0):
    """NCF inputs ``(user_ids, item_ids)`` (users uniform, items Zipf-like) and 0/1 clicks."""
    rng = worker_rng(seed, worker_index, num_workers)
    for _ in range(BATCHES_PER_EPOCH):
        u = rng.integers(0, users, size=(batch_size,), dtype=np.int32)
        i = zipf_ids(rng, items, (batch_size,))
        y = (rng.random(batch_size) < 0.2).astype(np.float32)
        yield (u, i), y


def click_log_batches(worker_index: int, num_workers: int, *, dense_features: int,
                      table_sizes: tuple[int, ...], batch_size: int, seed: int = 0):
    """Criteo-style inputs ``(dense, categorical)``: log-normal counts and one Zipf-like id per
    table; 0/1 click labels."""
    rng = worker_rng(seed, worker_index, num_workers)
    for _ in range(BATCHES_PER_EPOCH):
        dense = np.log1p(rng.lognormal(1.0, 1.0, size=(batch_size, dense_features))).astype(np.float32)
        cats = np.stack([zipf_ids(rng, n, (batch_size,)) for n in table_sizes], axis=1)
        y = (rng.random(batch_size) < 0.25).astype(np.float32)
        yield (dense, cats), y
