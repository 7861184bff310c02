"""Training on fewer workers with the global batch kept: each worker left draws, every step, the
batches of the workers it stands for (``keep_global_batch``).

The data is cut into as many parts as the workers it was first trained on (``dataset_fn(part,
parts)``). A worker holding several parts draws each step's batches from each of them in turn
(``interleaved``: the optimizer's ``gradient_accumulation_steps`` batches from one part, then from
the next) and hands over the sum of their gradients over its share (``TrainingWorker``): the
synchronizers' mean over the workers is then the mean over the parts, the gradient the
uninterrupted run would have applied, from the same batches in the same order. A step then
computes as many batches as the busiest worker holds parts, instead of the global batch
shrinking with the workers (Horovod's and Ray Train's elastic modes) and the learning rate,
tuned for it, no longer fitting.

Each part draws under its own seed (``random_seeds.worker_seed``) and keeps its own state of
Python's and numpy's process-wide generators between draws, so a ``dataset_fn`` that samples
with them draws what the part's own worker would have; TensorFlow's and Keras' global
generators are shared by the parts of one worker (a ``tf.data`` pipeline's ops take their seeds
when it is built, under the part's own seed).
"""
from __future__ import annotations

import random

import numpy as np

from strategy_space.errors import ConfigError


def interleaved(streams: list, chunk: int):
    """The items of ``streams`` (iterators), ``chunk`` at a time from each in turn, each drawn
    with its own state of Python's and numpy's global random generators; ends with the first
    stream that ends."""
    states: list = [None] * len(streams)
    while True:
        for k, stream in enumerate(streams):
            for _ in range(chunk):
                outer = random.getstate(), np.random.get_state()
                if states[k] is not None:
                    random.setstate(states[k][0])
                    np.random.set_state(states[k][1])
                try:
                    item = next(stream)
                except StopIteration:
                    return
                finally:
                    states[k] = random.getstate(), np.random.get_state()
                    random.setstate(outer[0])
                    np.random.set_state(outer[1])
                yield item


def assign(before: list, parts: list | None, after: list) -> list[tuple[int, ...]]:
    """The data parts each worker of ``after`` holds when the workers ``before`` (replica names,
    holding ``parts``, or one part each, their index, where None) go on as ``after``: every worker
    left keeps its parts, and each lost worker's go to the worker left that holds the fewest
    (the first of them), lost workers in order.

    Raises:
        ValueError: a worker of ``after`` is not one of ``before`` (only a shrink keeps the batch).
    """
    parts = [tuple(p) for p in parts] if parts is not None else [(i,) for i in range(len(before))]
    held = dict(zip(before, parts))
    new = [name for name in after if name not in held]
    if new:
        raise ValueError(f"worker(s) {', '.join(new)} did not train before: the parts go only to workers left")
    out = [list(held[name]) for name in after]
    for name, own in zip(before, parts):
        if name not in after:
            fewest = min(range(len(out)), key=lambda i: len(out[i]))
            out[fewest].extend(own)
    return [tuple(sorted(p)) for p in out]


def part_positions(states: list) -> tuple:
    """Each data part's position (batches drawn from it) from the workers' ``checkpoint_state``s:
    a worker's ``position`` is each of its parts' (``parts``: its parts and how many there are)."""
    if not states or "parts" not in states[0]:
        return tuple(s["position"] for s in states)
    out: list = [None] * states[0]["parts"][1]
    for state in states:
        for part in state["parts"][0]:
            out[part] = state["position"]
    if any(p is None for p in out):
        raise ValueError(f"data parts {[i for i, p in enumerate(out) if p is None]} are held by no worker")
    return tuple(out)


def restored(saved: int, workers: int, keep: bool) -> list | None:
    """The data parts of each of ``workers`` restoring a checkpoint of ``saved`` workers' data
    positions with ``keep_global_batch`` (``keep``): worker i draws parts i, i + workers, ...;
    None where each keeps one part (as many workers, or the global batch not kept).

    Raises:
        ConfigError: the global batch kept with more workers than the checkpoint's.
    """
    if not keep or saved == workers:
        return None
    if saved < workers:
        raise ConfigError(f"keep_global_batch: the checkpoint was trained on {saved} workers, fewer than the "
                          f"{workers} here, and one worker's batch cannot be split between workers: restore it "
                          f"with keep_global_batch=False (the global batch grows) or onto {saved} workers or fewer")
    return [tuple(range(i, saved, workers)) for i in range(workers)]
