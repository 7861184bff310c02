"""A parameter server's push from inside the worker's step (``sync.early_push``): which channels, the
push itself with fakes; on real Ray + TensorFlow and on emulated compute, the push leaves while the
step's collectives still run, and training is unchanged."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from autosync.runtime.sync.early_push import EarlyPush, early_channels
from strategy_space import PS, AllReduce, ComputeProfile, ModelSpec, Strategy, VarConfig, VariableSpec, validate


class _Channel:
    """A channel that records its pushes (step, gradients, thread)."""

    in_graph = False
    splits_pull = False

    def __init__(self, carries=(), early=False, in_graph=False):
        self.carries, self.pushes_early, self.in_graph = frozenset(carries), early, in_graph
        self.pushed = []

    def push(self, step, grads):
        self.pushed.append((step, grads, threading.current_thread().name))


def test_only_channels_that_push_early_and_only_beside_collectives_in_an_unheld_single_batch_step():
    ps, ar, graph = _Channel({0}, early=True), _Channel({1}), _Channel(in_graph=True)
    assert early_channels([graph, ps, ar], True, False, 1) == [ps]
    assert early_channels([graph, ps, ar], False, False, 1) == []   # nothing runs in the step
    assert early_channels([graph, ps, ar], True, True, 1) == []     # held: the norm needs every channel
    assert early_channels([graph, ps, ar], True, False, 2) == []    # accumulated: the sum comes after


def test_the_push_goes_to_its_channels_with_the_armed_step_and_the_rest_after_the_step():
    ps, ar = _Channel({0, 1}, early=True), _Channel({1, 2})
    early = EarlyPush([ps], [ps, ar])
    assert early.rest == [ar] and early.carries == {0, 1} and early.kept == {1}   # 1 is split
    checked = []
    early.arm(4, checked.append)
    grads = [np.ones(2), np.zeros(3), None]
    early(grads)
    early.done([None, None, None])    # pushed already: not again
    assert [(s, g) for s, g, _ in ps.pushed] == [(4, grads)] and checked == [grads] and not ar.pushed


def test_a_step_that_pushed_nothing_early_pushes_after_it_and_an_error_is_raised_after_the_step():
    ps = _Channel({0}, early=True)
    early = EarlyPush([ps], [ps])
    early.arm(0)
    early.done(["late"])
    assert [(s, g) for s, g, _ in ps.pushed] == [(0, ["late"])]

    def refuse(grads):
        raise RuntimeError("the step read rows [7] that the lookup-id function did not predict")

    early.arm(1, refuse)
    early(["x"])                                    # as TensorFlow's runtime calls it: no raise there
    with pytest.raises(RuntimeError, match=r"rows \[7\]"):
        early.done(["x"])
    assert len(ps.pushed) == 1
    early.arm(2)
    early.done(["y"])                               # the error does not outlive its step
    assert ps.pushed[-1][:2] == (2, ["y"])


def test_after_pushes_from_a_thread_at_its_time_and_done_waits_for_it():
    ps = _Channel({0}, early=True)
    early = EarlyPush([ps], [ps])
    early.arm(3)
    t0 = time.perf_counter()
    early.after(0.05, ["g"])
    assert not ps.pushed                            # not yet: the gradients are not ready
    early.done(["g"])
    assert time.perf_counter() - t0 >= 0.05
    assert ps.pushed == [(3, ["g"], "early push")]


def _starts(events, name):
    return {e[4]["step"]: (e[1], e[1] + e[2]) for e in events if e[0] == name}


@pytest.mark.integration
def test_a_tensorflow_workers_ps_push_leaves_inside_its_graph_step_and_trains_as_one_process(pool):
    """parallax with the ``graph`` backend: the embedding's push is issued from the step (its span
    starts before the step's compute ends, on another thread), the weights are one process's."""
    from autosync.runtime.runner import session_timeline
    from autosync.runtime.trainer import Trainer
    from strategy_space.builders import get_builder
    from tests import runtime_models as rm
    from tests.runtime_helpers import PAIR
    from tests.test_runtime_ps import STEPS, _model_spec

    md = rm.model_def("adam", learning_rate=0.05)
    spec = _model_spec(pool, md)
    strategy = get_builder("parallax", backend="graph").build(spec, PAIR)
    with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=1)
        session_timeline(trainer.session, True, time.monotonic() + 60)
        trainer.fit(steps=STEPS - 1, steps_per_call=2)
        streams = session_timeline(trainer.session, False, time.monotonic() + 60)
        weights = trainer.get_weights()
    for got, want, var in zip(weights, rm.reference_weights(md, num_workers=2, steps=STEPS), spec.variables):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=var.name)
    workers = {label: s["events"] for label, s in streams.items() if label.startswith("worker")}
    assert len(workers) == 2
    for label, events in workers.items():
        computes, pushes = _starts(events, "compute"), _starts(events, "ps push")
        assert sorted(pushes) == sorted(computes) == list(range(1, STEPS)), label
        for step, (start, _) in pushes.items():
            assert computes[step][0] < start < computes[step][1], (label, step)
        assert {e[3] for e in events if e[0] == "ps push"} != {e[3] for e in events if e[0] == "compute"}


@pytest.mark.integration
def test_an_emulated_workers_ps_push_leaves_while_its_in_step_collective_still_runs(ray_session):
    """A dense kernel's in-step collective outlasts the compute; the embedding's push, ready at the
    compute's end, leaves before that collective ends (it waited for it before); training is the
    numpy replay's."""
    from tests.runtime_helpers import PAIR
    from tests.test_runtime_emulated import numpy_reference, timed_session

    compute = 0.02
    spec = ModelSpec("early", (
        VariableSpec("emb", (4000, 8), sparse=True, rows_per_step=50),
        VariableSpec("dense/kernel", (512, 1024)),      # 2 MiB through gloo: longer than the compute
    ), batch_size=8, profile=ComputeProfile(compute, "test", ("dense/kernel", "emb")))
    strategy = Strategy((VarConfig("emb", (PS("node0"),)),
                         VarConfig("dense/kernel", (AllReduce(backend="auto", group=0),))))
    validate(strategy, spec, PAIR)
    weights, streams = timed_session(spec, strategy, compute, 4)
    for got, want, var in zip(weights, numpy_reference(spec, 7, 2, 4, 0.01), spec.variables):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=var.name)
    overlapped = 0
    for label, stream in streams.items():
        if not label.startswith("worker"):
            continue
        pushes, collectives = _starts(stream["events"], "ps push"), _starts(stream["events"], "allreduce (in step)")
        computes = _starts(stream["events"], "compute")
        assert sorted(pushes) == sorted(collectives) == [0, 1, 2, 3], label
        for step, (start, _) in pushes.items():
            assert start >= computes[step][0] + 0.9 * compute * 1e6, (label, step)   # ready at the compute's end
            overlapped += start < collectives[step][1]
    assert overlapped >= 6, overlapped   # of 8 (worker, step) pairs: a collective may end early on one

