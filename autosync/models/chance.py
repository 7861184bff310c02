"""Chance-level loss of a zoo model: the loss of the best prediction that ignores the inputs,
estimated from the model's own data stream (numpy only; no TensorFlow).

A model has learned something from its data when its loss falls clearly below this level:
``ln(classes)`` for the image classifiers (balanced labels), the entropy of the click rate for the
recommenders, the entropy of the token distribution for BERT's reconstruction, and for the
sampled-softmax language model the sampled loss of the unigram model (the token frequencies as
logits, through the same log-uniform candidate sampler and correction as the model's loss).
"""
from __future__ import annotations

import itertools

import numpy as np

from . import batches as B


def chance_loss(model_def, batches: int = 400) -> float:
    """The chance-level loss of a zoo ``model_def`` (``autosync.models.zoo.get_model_def``).

    Args:
        model_def: a zoo ModelDef (its ``metadata['zoo']`` names the model).
        batches: how many batches of worker 0's stream the estimate reads.

    Raises:
        ValueError: not a zoo model.
    """
    name = model_def.metadata.get("zoo")
    stream = itertools.islice(model_def.dataset_fn(0, 1), batches)
    if name in ("resnet50", "vgg16"):
        return float(np.log(model_def.dataset_fn.keywords["classes"]))
    if name in ("ncf", "dlrm"):
        p = float(np.mean([np.mean(y) for _, y in stream]))
        return float(-(p * np.log(p) + (1 - p) * np.log(1 - p)))
    if name == "bert":
        vocab = model_def.dataset_fn.keywords["vocab"]
        counts = np.bincount(np.concatenate([y.ravel() for _, y in stream]), minlength=vocab)
        p = counts[counts > 0] / counts.sum()
        return float(-np.sum(p * np.log(p)))
    if name == "lm1b":
        return _sampled_unigram_loss(model_def, list(stream))
    raise ValueError(f"chance_loss knows the zoo models only, got {model_def.name!r}")


def _sampled_unigram_loss(model_def, stream) -> float:
    vocab = model_def.dataset_fn.keywords["vocab"]
    # the model's own sampler settings: model_fn is partial(build_part, "_text:lstm_lm", **kwargs)
    num_sampled = model_def.model_fn.keywords["num_sampled"]
    half = len(stream) // 2
    # unigram frequencies from one half of the stream (add-one smoothed), scored on the other
    counts = np.bincount(np.concatenate([x[1].ravel() for x, _ in stream[:half]]), minlength=vocab) + 1.0
    log_p = np.log(counts / counts.sum())
    ids = np.arange(vocab, dtype=np.float64)
    log_q = np.log(num_sampled * (np.log(ids + 2.0) - np.log(ids + 1.0)) / np.log(vocab + 1.0))
    corrected = log_p - log_q
    rng = np.random.default_rng(0)
    losses = []
    for (_, labels), _ in stream[half:]:
        y = labels.ravel()
        sampled = B.zipf_ids(rng, vocab, num_sampled)
        logits = np.concatenate([corrected[y][:, None], np.broadcast_to(corrected[sampled], (len(y), num_sampled))], 1)
        logits[:, 1:][sampled[None, :] == y[:, None]] = -np.inf   # accidental hits removed, as the model does
        top = logits.max(axis=1, keepdims=True)
        losses.append(np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0] - logits[:, 0])
    return float(np.mean(np.concatenate(losses)))
