"""Chance-level loss of a zoo model: the loss of the best prediction that ignores the inputs,
estimated from the model's own data stream (numpy only; no TensorFlow).

A model has learned something from its data when its loss falls clearly below this level:
``ln(classes)`` for the image classifiers (balanced labels), the entropy of the click rate for the
recommenders, for BERT's reconstruction the entropy of each position's token law (averaged over the
positions), and for the sampled-softmax language model the sampled loss of the unigram model (each
position's token law as logits, through the same log-uniform candidate sampler and correction as
the model's loss). The text models' token laws are exact (``batches.markov_marginals``), not
counted from a sample: counts of a large vocabulary in a few hundred batches miss most of its
tail and would put chance too high (lm1b: 5.00 from 100 batches, 4.53 from 400).
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
        data = model_def.dataset_fn.keywords
        law = B.markov_marginals(data["vocab"], data["seq_len"], data.get("seed", 0))
        return float(np.mean(-np.sum(law * np.log(np.where(law > 0, law, 1.0)), axis=1)))
    if name == "lm1b":
        return _sampled_unigram_loss(model_def, list(stream))
    raise ValueError(f"chance_loss knows the zoo models only, got {model_def.name!r}")


def _sampled_unigram_loss(model_def, stream) -> float:
    data = model_def.dataset_fn.keywords
    vocab, seq_len = data["vocab"], data["seq_len"]
    # the model's own sampler settings: model_fn is partial(build_part, "_text:lstm_lm", **kwargs)
    num_sampled = model_def.model_fn.keywords["num_sampled"]
    # the labels are positions 1..seq_len of a window of seq_len + 1 tokens
    law = B.markov_marginals(vocab, seq_len + 1, data.get("seed", 0))[1:]
    log_q = np.log(num_sampled * B.zipf_pmf(vocab))
    rng = np.random.default_rng(0)
    losses = []
    for (_, labels), _ in stream:
        position = np.broadcast_to(np.arange(seq_len), labels.shape).ravel()
        y = labels.ravel()
        sampled = B.zipf_ids(rng, vocab, num_sampled)
        true = np.log(law[position, y]) - log_q[y]
        other = np.log(law[position[:, None], sampled[None, :]]) - log_q[sampled][None, :]
        logits = np.concatenate([true[:, None], other], 1)
        logits[:, 1:][sampled[None, :] == y[:, None]] = -np.inf   # accidental hits removed, as the model does
        top = logits.max(axis=1, keepdims=True)
        losses.append(np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0] - logits[:, 0])
    return float(np.mean(np.concatenate(losses)))
