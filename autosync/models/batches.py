"""Synthetic, deterministic data streams for the zoo models (no downloads), with structure a
model can learn.

Each stream is endless: worker ``i`` of ``n`` draws its examples from a generator seeded by
``(seed, i, n)``, so shards differ between workers and repeat exactly. What is to be learned (a
teacher) depends on ``seed`` alone, so every worker samples the same task:

* images: each class has a fixed random low-resolution colour pattern; an image is its class's
  pattern, upsampled, under pixel noise (labels balanced over the classes; VGG, which has no
  normalization layers, gets a stronger pattern: see ``autosync.models.zoo``);
* text: a Markov chain over a Zipf-like vocabulary: after token ``t`` comes, with probability
  ``MARKOV_FOLLOW``, one of ``MARKOV_SUCCESSORS`` fixed successors of ``t`` (drawn Zipf-like
  once), otherwise a fresh Zipf-like token. BERT reconstructs every token of a sequence in which
  15 % of the positions are masked; the LSTM predicts the next token;
* interactions (NCF): a latent-factor teacher: a click where an item's popularity plus a user's
  activity plus the dot product of fixed random user and item factors passes a threshold;
* click logs (DLRM): a teacher that sums one fixed random weight per categorical id (per table)
  and a fixed linear function of the dense features, thresholded.

Ids stay Zipf-like (items, words, categorical values) and users uniform, as before, so the rows a
step touches (``rows_per_step``) keep their realistic counts. The teachers' parameters are hashes
of (seed, table, id), never tables, so even the full-size vocabularies cost nothing to set up; a
vocabulary of up to ``TABLE_MAX_VALUES`` parameters has them hashed once per process and looked up
after (``teacher_table``: the same values bit for bit), so a small model's step does not re-hash
its batch's ids (ncf-small's worker spent a fifth of its CPU doing that, beside the training step
on the same two cores).

Every generator is a module-level function so that ``functools.partial`` of it pickles.
"""
from __future__ import annotations

import numpy as np

# Criteo Kaggle display-advertising categorical cardinalities, as used by DLRM's Kaggle setup
CRITEO_KAGGLE_TABLES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
CRITEO_DENSE_FEATURES = 13

# the text source: how often a token is followed by one of its fixed successors, and how many
MARKOV_FOLLOW = 0.85
MARKOV_SUCCESSORS = 1
# BERT: share of positions masked (replaced by the mask token, the vocabulary's last id)
MASK_SHARE = 0.15
# images: side of the low-resolution class pattern, pattern strength and pixel noise
PATTERN_CELLS = 4
PATTERN_SCALE = 0.08
PIXEL_NOISE = 0.5
# share of positive labels the recommenders' teachers aim at
CLICK_RATE = 0.25

# salts that keep the hashed teacher parameters of different roles apart
_PATTERN, _SUCCESSOR, _USER, _ITEM, _USER_BIAS, _ITEM_BIAS, _TABLE, _DENSE = range(1, 9)
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
# the most parameters (ids x width) a teacher's table may have to be laid out (8 MiB of float64);
# larger vocabularies are hashed batch by batch
TABLE_MAX_VALUES = 1 << 20
_TABLES: dict = {}


def worker_rng(seed: int, worker_index: int, num_workers: int) -> np.random.Generator:
    """A generator seeded by (seed, worker index, worker count)."""
    if not 0 <= worker_index < num_workers:
        raise ValueError(f"worker_index must be in [0, {num_workers}), got {worker_index}")
    return np.random.default_rng([seed, worker_index, num_workers])


def zipf_ids(rng: np.random.Generator, vocab: int, size) -> np.ndarray:
    """Ids in [0, vocab) from a log-uniform (Zipf-like) law, as in word and item frequencies:
    P(id) is proportional to log((id + 2) / (id + 1))."""
    return zipf_from_uniform(rng.random(size), vocab)


def zipf_from_uniform(u: np.ndarray, vocab) -> np.ndarray:
    """``zipf_ids``'s law applied to uniforms ``u`` in [0, 1) (a deterministic inverse CDF);
    ``vocab`` an int or an array that broadcasts against ``u`` (a vocabulary per row, say)."""
    ids = np.floor(np.exp(u * np.log(vocab + 1.0))).astype(np.int64) - 1
    return np.clip(ids, 0, vocab - 1).astype(np.int32)


def hash_uniform(seed: int, salt: int, *keys) -> np.ndarray:
    """Uniforms in [0, 1), a fixed function of (seed, salt, keys...) (element-wise over the
    broadcast integer arrays ``keys``): the teachers' parameters, looked up without tables."""
    with np.errstate(over="ignore"):
        h = np.uint64((seed * 0x9E3779B97F4A7C15 + salt * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF)
        for k in keys:
            h = _mix(h ^ (np.asarray(k).astype(np.uint64) + np.uint64(0x632BE59BD9B4E019)))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def hash_normal(seed: int, salt: int, *keys) -> np.ndarray:
    """Standard normals, a fixed function of (seed, salt, keys...) (Box-Muller on two hashes)."""
    u1 = hash_uniform(seed, salt, *keys, 0)
    u2 = hash_uniform(seed, salt, *keys, 1)
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2 * np.pi * u2)


def teacher_table(seed: int, salt: int, vocab: int, *keys) -> np.ndarray | None:
    """``hash_normal(seed, salt, *keys, ids)`` laid out for every id in ``[0, vocab)`` (the last
    axis), made once per process and read-only; None where it would hold more than
    ``TABLE_MAX_VALUES`` values (hash the ids instead). ``keys`` are integers (a table's number)."""
    if vocab > TABLE_MAX_VALUES:
        return None
    key = (seed, salt, vocab, keys)
    table = _TABLES.get(key)
    if table is None:
        table = hash_normal(seed, salt, *keys, np.arange(vocab))
        table.flags.writeable = False
        table = _TABLES.setdefault(key, table)
    return table


def _factors(seed: int, salt: int, ids: np.ndarray, factors: int, vocab: int | None) -> np.ndarray:
    """``hash_normal(seed, salt, ids[:, None], arange(factors))``, from a per-factor table of
    ``vocab`` ids where one fits (``teacher_table``)."""
    k = np.arange(factors)
    if vocab is not None and vocab * factors <= TABLE_MAX_VALUES:
        table = _TABLES.get((seed, salt, vocab, ("factors", factors)))
        if table is None:
            table = hash_normal(seed, salt, np.arange(vocab)[:, None], k)
            table.flags.writeable = False
            table = _TABLES.setdefault((seed, salt, vocab, ("factors", factors)), table)
        return table[ids]
    return hash_normal(seed, salt, ids[:, None], k)


def _mix(x):
    # splitmix64's finalizer: every input bit affects every output bit
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))) & _MASK64


def image_batches(worker_index: int, num_workers: int, *, image_size: int, classes: int,
                  batch_size: int, seed: int = 0, pattern_scale: float = PATTERN_SCALE):
    """Images in [0, 1): the label's fixed random colour pattern (``PATTERN_CELLS`` squared
    cells) times ``pattern_scale``, upsampled, plus Gaussian pixel noise (``PIXEL_NOISE``);
    integer labels, uniform over the classes."""
    rng = worker_rng(seed, worker_index, num_workers)
    g = PATTERN_CELLS
    cells = np.arange(g * g * 3).reshape(g, g, 3)
    up = -(-image_size // g)
    while True:
        y = rng.integers(0, classes, size=(batch_size,), dtype=np.int32)
        pattern = hash_normal(seed, _PATTERN, y[:, None, None, None], cells[None]).astype(np.float32)
        pattern = np.repeat(np.repeat(pattern, up, axis=1), up, axis=2)[:, :image_size, :image_size]
        noise = rng.standard_normal((batch_size, image_size, image_size, 3), dtype=np.float32)
        x = np.clip(0.5 + pattern_scale * pattern + PIXEL_NOISE * noise, 0.0, 1.0)
        yield x, y


def markov_text(rng: np.random.Generator, vocab: int, shape: tuple[int, int], seed: int) -> np.ndarray:
    """``shape[0]`` token sequences of length ``shape[1]`` from the zoo's Markov text source."""
    rows, length = shape
    out = np.empty((rows, length), dtype=np.int32)
    out[:, 0] = zipf_ids(rng, vocab, rows)
    follow = rng.random((rows, length)) < MARKOV_FOLLOW
    pick = rng.integers(0, MARKOV_SUCCESSORS, size=(rows, length))
    fresh = zipf_ids(rng, vocab, (rows, length))
    for j in range(1, length):
        successor = zipf_from_uniform(hash_uniform(seed, _SUCCESSOR, out[:, j - 1], pick[:, j]), vocab)
        out[:, j] = np.where(follow[:, j], successor, fresh[:, j])
    return out


def zipf_pmf(vocab: int) -> np.ndarray:
    """``zipf_ids``'s probabilities: P(id) = log((id + 2) / (id + 1)) / log(vocab + 1)."""
    ids = np.arange(vocab, dtype=np.float64)
    return (np.log(ids + 2.0) - np.log(ids + 1.0)) / np.log(vocab + 1.0)


def markov_marginals(vocab: int, length: int, seed: int) -> np.ndarray:
    """The exact law of the token at each position of ``markov_text``'s sequences: row ``j`` is
    P(token j = t) over ``t`` in [0, vocab) (position 0 is Zipf-like; each next one mixes fresh
    Zipf-like tokens with the previous position's law carried through the fixed successors).
    Costs a hash per (token, successor) and one pass per position, so even 800k tokens take ~2 s."""
    z = zipf_pmf(vocab)
    successors = [zipf_from_uniform(hash_uniform(seed, _SUCCESSOR, np.arange(vocab), k), vocab)
                  for k in range(MARKOV_SUCCESSORS)]
    rows = [z]
    for _ in range(1, length):
        carried = sum(np.bincount(s, weights=rows[-1], minlength=vocab) for s in successors) / len(successors)
        rows.append((1.0 - MARKOV_FOLLOW) * z + MARKOV_FOLLOW * carried)
    return np.stack(rows)


def masked_lm_batches(worker_index: int, num_workers: int, *, vocab: int, seq_len: int,
                      batch_size: int, seed: int = 0):
    """BERT-style inputs ``(token_ids, segment_ids)`` — Markov text with ``MASK_SHARE`` of the
    positions replaced by the mask token (id ``vocab - 1``) — and the original token at every
    position as the target."""
    rng = worker_rng(seed, worker_index, num_workers)
    while True:
        targets = markov_text(rng, vocab, (batch_size, seq_len), seed)
        masked = rng.random((batch_size, seq_len)) < MASK_SHARE
        tokens = np.where(masked, vocab - 1, targets).astype(np.int32)
        split = rng.integers(1, seq_len, size=(batch_size, 1))
        segments = (np.arange(seq_len)[None, :] >= split).astype(np.int32)
        yield (tokens, segments), targets


def language_model_batches(worker_index: int, num_workers: int, *, vocab: int, seq_len: int,
                           batch_size: int, seed: int = 0):
    """Windows of Markov text: inputs ``(tokens, next_tokens)``, targets unused zeros (the model
    returns its per-token sampled-softmax loss)."""
    rng = worker_rng(seed, worker_index, num_workers)
    while True:
        window = markov_text(rng, vocab, (batch_size, seq_len + 1), seed)
        yield (window[:, :-1], window[:, 1:]), np.zeros((batch_size, seq_len), np.float32)


def interaction_score(users: np.ndarray, items: np.ndarray, seed: int, factors: int = 8,
                      vocab: tuple[int, int] | None = None) -> np.ndarray:
    """The NCF teacher's score of (user, item) pairs: item popularity + user activity + the dot
    product of fixed random ``factors``-dimensional user and item factors (all of unit scale).
    ``vocab``: the (users, items) counts, to look the parameters up in tables where they fit."""
    n_users, n_items = vocab if vocab is not None else (None, None)
    dot = np.sum(_factors(seed, _USER, users, factors, n_users) * _factors(seed, _ITEM, items, factors, n_items), axis=1)
    return (2.0 * _lookup(seed, _ITEM_BIAS, items, n_items) + 0.5 * _lookup(seed, _USER_BIAS, users, n_users)
            + dot / np.sqrt(factors))


def _lookup(seed: int, salt: int, ids: np.ndarray, vocab: int | None, *keys) -> np.ndarray:
    """``hash_normal(seed, salt, *keys, ids)``, from ``teacher_table`` where it fits."""
    table = None if vocab is None else teacher_table(seed, salt, vocab, *keys)
    return hash_normal(seed, salt, *keys, ids) if table is None else table[ids]


def interaction_batches(worker_index: int, num_workers: int, *, users: int, items: int,
                        batch_size: int, seed: int = 0):
    """NCF inputs ``(user_ids, item_ids)`` (users uniform, items Zipf-like) and 0/1 clicks: 1
    where the teacher's score (``interaction_score``) is in its top ``CLICK_RATE``."""
    threshold = _quantile_threshold(lambda r, n: interaction_score(
        r.integers(0, users, size=n), zipf_ids(r, items, n), seed, vocab=(users, items)), seed)
    rng = worker_rng(seed, worker_index, num_workers)
    while True:
        u = rng.integers(0, users, size=(batch_size,), dtype=np.int32)
        i = zipf_ids(rng, items, (batch_size,))
        y = (interaction_score(u, i, seed, vocab=(users, items)) > threshold).astype(np.float32)
        yield (u, i), y


def click_score(dense: np.ndarray, cats: np.ndarray, seed: int, table_sizes: tuple[int, ...] | None = None) -> np.ndarray:
    """The DLRM teacher's score: a fixed random weight per (table, id), summed over the tables
    and scaled to unit variance, plus a fixed random linear function of the dense features (of
    unit variance too). ``table_sizes``: each table's ids, to look the weights of the tables that
    fit up in tables (``teacher_table``)."""
    tables = np.arange(cats.shape[1])
    laid = {} if table_sizes is None else {t: teacher_table(seed, _TABLE, n, t) for t, n in enumerate(table_sizes)}
    laid = {t: table for t, table in laid.items() if table is not None}
    if not laid:
        weights = hash_normal(seed, _TABLE, tables[None, :], cats)
    else:   # the tables that fit looked up, the others hashed together
        weights = np.empty(cats.shape, np.float64)
        hashed = np.array([t for t in tables if t not in laid], dtype=np.int64)
        if len(hashed):
            weights[:, hashed] = hash_normal(seed, _TABLE, hashed[None, :], cats[:, hashed])
        for t, table in laid.items():
            weights[:, t] = table[cats[:, t]]
    categorical = weights.sum(axis=1) / np.sqrt(cats.shape[1])
    w = hash_normal(seed, _DENSE, np.arange(dense.shape[1]))
    # the dense features (log1p of log-normal counts) have mean ~1.3 and deviation ~0.6
    return categorical + (dense - 1.3) @ w / (0.6 * np.sqrt(dense.shape[1]))


def click_log_batches(worker_index: int, num_workers: int, *, dense_features: int,
                      table_sizes: tuple[int, ...], batch_size: int, seed: int = 0):
    """Criteo-style inputs ``(dense, categorical)``: log-normal counts and one Zipf-like id per
    table; 0/1 clicks: 1 where the teacher's score (``click_score``) is in its top ``CLICK_RATE``."""

    def draw(r, n):
        dense = np.log1p(r.lognormal(1.0, 1.0, size=(n, dense_features))).astype(np.float32)
        # one uniform draw for every table, table after table: the stream of a draw per table
        u = r.random((len(table_sizes), n))
        cats = np.ascontiguousarray(zipf_from_uniform(u, np.asarray(table_sizes, np.int64)[:, None]).T)
        return dense, cats

    threshold = _quantile_threshold(lambda r, n: click_score(*draw(r, n), seed, table_sizes), seed)
    rng = worker_rng(seed, worker_index, num_workers)
    while True:
        dense, cats = draw(rng, batch_size)
        y = (click_score(dense, cats, seed, table_sizes) > threshold).astype(np.float32)
        yield (dense, cats), y


def _quantile_threshold(score, seed: int, n: int = 20_000) -> float:
    """The score above which ``CLICK_RATE`` of the examples lie, from a fixed sample of the
    stream (its own generator, so every worker gets the same threshold)."""
    return float(np.quantile(score(np.random.default_rng([seed, 0xC11C]), n), 1.0 - CLICK_RATE))
