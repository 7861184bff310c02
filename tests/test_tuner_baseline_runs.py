"""``autosync baselines``' measuring loop against fake runners (issue 17, items 5 and 6)."""
from __future__ import annotations

import dataclasses

from strategy_space import ConfigError, ModelSpec, VariableSpec
from strategy_space.builders import BUILDERS, get_builder
from tests.fakes import three_node_cluster, tiny_model
from tuner.search.baseline_runs import measure_baselines
from tuner.synthetic.runner import SyntheticRunner

MODEL, CLUSTER = tiny_model(profile=True), three_node_cluster()


class Counting(SyntheticRunner):
    """Records every strategy it runs; fails the first run of the builders in ``fail_once``
    and every run of those in ``fail_always``."""

    def __init__(self, *a, fail_once=(), fail_always=(), time_out=(), **k):
        super().__init__(*a, **k)
        self.ran: list[str] = []
        self.fail_once, self.fail_always, self.time_out = set(fail_once), set(fail_always), set(time_out)

    def run(self, strategies, origins=None):
        out = []
        for t in super().run(strategies, origins):
            self.ran.append(t.origin)
            if t.origin in self.fail_always or t.origin in self.fail_once:
                self.fail_once.discard(t.origin)
                t = dataclasses.replace(t, status="failed", step_times=(), error="parameter server ps@h1 died")
            elif t.origin in self.time_out:
                t = dataclasses.replace(t, status="timeout", step_times=(), error="exceeded the trial limit of 300 s")
            out.append(t)
        return out


def test_builders_with_identical_strategies_share_one_trial():
    """Issue 17, item 5: byte-identical (or group-renumbered) strategies are measured once (a
    model without sparse variables: several builders make the same strategy)."""
    model = ModelSpec("dense", (VariableSpec("a", (64, 32)), VariableSpec("b", (32,))), batch_size=8)
    built = {n: get_builder(n).build(model, CLUSTER) for n in BUILDERS}
    distinct = {s.canonical().fingerprint for s in built.values()}
    assert len(distinct) < len(built)
    runner = Counting(model, CLUSTER, seed=0)
    runs = measure_baselines(runner)
    assert [r.builder for r in runs] == list(BUILDERS)
    assert len(runner.ran) == len(distinct)
    for r in runs:
        if r.same_as is not None:
            owner = next(o for o in runs if o.builder == r.same_as)
            assert r.trial is owner.trial and r.builder in owner.aliases
            assert built[r.builder].canonical().fingerprint == built[r.same_as].canonical().fingerprint


def test_a_failed_baseline_is_retried_once_then_dropped():
    """Issue 17, item 6."""
    runner = Counting(MODEL, CLUSTER, seed=0, fail_once={"ps"}, fail_always={"all_reduce"})
    runs = {r.builder: r for r in measure_baselines(runner)}
    assert runs["ps"].trial.ok and runs["ps"].attempts == 2 and "ps@h1 died" in runs["ps"].first_error
    assert not runs["all_reduce"].trial.ok and runs["all_reduce"].attempts == 2
    assert runner.ran.count("ps") == 2 and runner.ran.count("all_reduce") == 2
    ok_first = [r for r in runs.values() if r.same_as is None and r.builder not in ("ps", "all_reduce")]
    assert ok_first and all(r.attempts == 1 and not r.first_error for r in ok_first)


def test_a_baseline_that_timed_out_is_not_run_again():
    """Too slow for the trial limit once is too slow again: rerunning it spends a whole limit."""
    runner = Counting(MODEL, CLUSTER, seed=0, time_out={"all_reduce"})
    runs = {r.builder: r for r in measure_baselines(runner)}
    assert runs["all_reduce"].trial.status == "timeout" and runs["all_reduce"].attempts == 1
    assert runner.ran.count("all_reduce") == 1


def test_a_strategy_the_runtime_cannot_run_is_reported_not_run():
    def check(strategy):
        if strategy.origin == "parallax":
            raise ConfigError("not supported here")

    runner = Counting(MODEL, CLUSTER, seed=0)
    runs = {r.builder: r for r in measure_baselines(runner, check=check)}
    assert runs["parallax"].unsupported == "not supported here" and runs["parallax"].trial is None
    assert "parallax" not in runner.ran
