"""The runtime takes resolved objects (a ModelDef, or a ModelSpec for emulated compute; a Strategy;
a ClusterSpec); resolving names and files is the API's (``make_runner``, ``make_trainer``), which
hands the runtime what it resolved. Nothing here starts Ray or TensorFlow."""
from __future__ import annotations

import pytest

from autosync.model_def import ModelDef
from strategy_space import (PS, AllReduce, ClusterSpec, ConfigError, ModelSpec, NodeSpec, Strategy, VarConfig,
                            VariableSpec)

CLUSTER = ClusterSpec("pair", (NodeSpec("a", workers=2, chief=True),))
SPEC = ModelSpec("tiny", (VariableSpec("w", (4, 4)),), batch_size=8)
STRATEGY = Strategy((VarConfig("w", (AllReduce(),)),))
STRATEGY_YAML = "kind: strategy\nversion: 1\nvariables:\n- var: w\n  all_reduce: {}\n"


def _model_def() -> ModelDef:
    never = lambda *a: None  # noqa: E731 - the factories are not called before Ray starts
    return ModelDef(name="tiny", model_fn=never, loss_fn=never, optimizer_fn=never, dataset_fn=never, batch_size=8)


def test_the_runtime_refuses_names_and_says_where_to_resolve_them():
    from autosync.runtime.runner import RayRunner, emulated_setup
    from autosync.runtime.trainer import Trainer

    md = _model_def()
    hint = r"resolve names and files .* autosync\.make_runner"
    with pytest.raises(TypeError, match=r"the cluster must be a ClusterSpec, got 'local'; the runtime takes resolved objects: " + hint):
        RayRunner(md, "local")
    with pytest.raises(TypeError, match=r"the model must be a ModelDef, got 'zoo:ncf'; .*" + hint):
        RayRunner("zoo:ncf", CLUSTER)
    with pytest.raises(TypeError, match=r"an emulated-compute model must be a ModelSpec or EmulatedModelDef, "
                                        r"got 'ncf\.yaml'"):
        RayRunner("ncf.yaml", CLUSTER, compute="emulated")
    with pytest.raises(TypeError, match=r"the model must be a ModelDef, got 'zoo:ncf'"):
        Trainer("zoo:ncf", STRATEGY, CLUSTER)
    with pytest.raises(TypeError, match=r"the strategy must be a Strategy, got 'best\.yaml'"):
        Trainer(md, "best.yaml", CLUSTER)
    with pytest.raises(TypeError, match=r"the cluster must be a ClusterSpec, got 'local'"):
        Trainer(md, STRATEGY, "local")
    # resolved objects pass: emulated compute builds its model from the spec on the marked cluster
    emulated, cluster, spec = emulated_setup(SPEC, CLUSTER, None, 0.01, "sgd")
    assert cluster.compute == "emulated" and spec.variables == SPEC.variables and emulated.spec == spec


class _Recorder:
    """Stands in for a runtime class: records what it was given instead of starting Ray."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def test_the_api_resolves_names_and_files_before_the_runtime(monkeypatch, tmp_path):
    import autosync
    import autosync.runtime.runner as runner_module
    import autosync.runtime.trainer as trainer_module
    from strategy_space.yaml_io import save

    monkeypatch.setattr(runner_module, "RayRunner", _Recorder)
    monkeypatch.setattr(trainer_module, "Trainer", _Recorder)
    spec_path, strategy_path = tmp_path / "tiny.yaml", tmp_path / "best.yaml"
    save(SPEC, spec_path)
    strategy_path.write_text(STRATEGY_YAML)

    runner = autosync.make_runner(str(spec_path), "local", compute="emulated", step_time_s=0.01, steps=3)
    model, cluster = runner.args
    assert isinstance(model, ModelSpec) and model.variables == SPEC.variables
    assert isinstance(cluster, ClusterSpec) and cluster.name == "local"
    assert runner.kwargs["compute"] == "emulated" and runner.kwargs["steps"] == 3

    trainer = autosync.make_trainer("zoo:ncf?size=small", str(strategy_path), "local", timeout_s=5.0)
    model_def, strategy, cluster = trainer.args
    assert isinstance(model_def, ModelDef) and model_def.name == "ncf-small"
    assert strategy == STRATEGY and cluster.name == "local" and trainer.kwargs == {"timeout_s": 5.0}


def test_bad_names_are_config_errors_from_the_api():
    import autosync

    with pytest.raises(ConfigError, match="unknown cluster 'nowhere'"):
        autosync.make_runner(SPEC, "nowhere", compute="emulated")
    with pytest.raises(ConfigError, match="unknown model 'ncf'"):
        autosync.make_trainer("ncf", STRATEGY, CLUSTER)
    with pytest.raises(ConfigError, match="is a model spec"):
        autosync.make_runner("spec.yaml", CLUSTER)


def test_make_trainer_takes_a_builders_name_for_its_strategy(monkeypatch, tmp_path):
    """``make_trainer(model, "ps", cluster)``: the strategy that builder makes for the model and
    cluster (a new user's first guess; it was 'file not found: ps'); a file of that name wins; a
    name that is neither says so and lists the builders."""
    import autosync
    import autosync.models.ingest as ingest
    import autosync.runtime.trainer as trainer_module
    from autosync.sources import local_cluster
    from strategy_space.builders import get_builder

    monkeypatch.setattr(trainer_module, "Trainer", _Recorder)
    monkeypatch.setattr(ingest, "model_spec_from_def", lambda md: SPEC)   # what building the model would measure
    for name in ("ps", "all_reduce"):
        _, strategy, cluster = autosync.make_trainer(_model_def(), name, "local").args
        assert strategy == get_builder(name).build(SPEC, local_cluster()) and cluster.name == "local"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ps").write_text(STRATEGY_YAML)
    assert autosync.make_trainer(_model_def(), "ps", "local").args[1] == STRATEGY
    with pytest.raises(ConfigError, match=r"strategy 'pss' is neither a strategy YAML file nor a builder's name; .*"
                                          r"a builder: ps, .*all_reduce"):
        autosync.make_trainer(_model_def(), "pss", "local")


class _FailingPool:
    """A WorkerPool whose workers fail to build the model; records where PS were expected."""

    description = None

    def __init__(self, error: str):
        from autosync.runtime.engine import TrialFailed, TrialTimeout

        self.binding = type("Binding", (), {"cluster": CLUSTER})()
        self.failure = (TrialFailed("worker a:0 failed: RuntimeError: boom") if error == "failed"
                        else TrialTimeout("worker a:1 did not load in 300 s"))
        self.expected = []
        self.ps = type("PsPool", (), {"expect": lambda _, model_def, nodes: self.expected.append(tuple(nodes))})()

    def ensure(self, model_def, slots, deadline):
        raise self.failure

    def kill_all(self):   # a failed trial's clean-up
        pass

    def close(self):
        pass


@pytest.mark.parametrize("error", ["failed", "timeout"])
def test_a_model_the_workers_cannot_load_is_a_config_error_that_says_what_failed(error):
    """``tune`` asks the runner for the workers' optimizer before its first trial, ``baselines``
    for the model the builders build for: a model whose ``model_fn`` raises in the workers only was
    a traceback (TrialFailed, exit 1), now a message (exit 2 from the commands) naming the model,
    the cluster and the worker's error."""
    from autosync.runtime.runner import RayRunner

    runner = RayRunner(_model_def(), CLUSTER, pool=_FailingPool(error))
    said = "worker a:0 failed: RuntimeError: boom" if error == "failed" else "worker a:1 did not load in 300 s"
    for ask in (runner.optimizer_config, lambda: runner.model):
        with pytest.raises(ConfigError, match=f"the workers could not load model tiny on cluster pair: {said}; check "
                                              f"that the model trains on this cluster"):
            ask()
    trial = runner.run_one(STRATEGY, "hand")   # a trial records the load's failure as its own, as before
    assert trial.status == error and said in trial.error and not runner.loaded


def test_a_trainer_of_a_model_the_workers_cannot_load_raises_the_same_config_error(monkeypatch):
    """``make_trainer`` raised the runtime's TrialFailed (a class of the engine, not of the API)."""
    import autosync.runtime.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "check_model_optimizer", lambda model_def: {})
    for error, said in [("failed", "worker a:0 failed: RuntimeError: boom"),
                        ("timeout", "worker a:1 did not load in 300 s")]:
        with pytest.raises(ConfigError, match=f"the workers could not load model tiny on cluster pair: {said}; check "
                                              f"that the model trains on this cluster"):
            trainer_module.Trainer(_model_def(), STRATEGY, CLUSTER, pool=_FailingPool(error))


def test_run_of_a_model_the_workers_cannot_load_exits_2_with_the_message(monkeypatch, tmp_path, capsys):
    """``autosync run`` of a model whose code raises in the workers (a dataset_fn that yields
    nothing on worker 1) was "trial failed" and exit 1; tune said the same as a message, exit 2.
    A trial that times out stays one (exit 1: tests/test_cli_runtime.py); the parameter servers
    are expected only where the strategy puts them."""
    import autosync.cli.runtime as cli_runtime
    from autosync.cli import main
    from autosync.runtime.runner import RayRunner
    from strategy_space.yaml_io import save

    ps_strategy = Strategy((VarConfig("w", (PS("a"),)),))
    save(ps_strategy, tmp_path / "s.yaml")
    pool = _FailingPool("failed")
    monkeypatch.setattr(cli_runtime, "_prepare", lambda args: (_model_def(), SPEC, CLUSTER))
    monkeypatch.setattr(cli_runtime, "_runner", lambda args, md, spec, cluster, **kw: RayRunner(md, cluster, pool=pool))
    assert main(["run", "--model", "x.py:build", "--strategy", str(tmp_path / "s.yaml"), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert ("autosync run: error: the workers could not load model tiny on cluster pair: worker a:0 failed: "
            "RuntimeError: boom" in captured.err)
    assert pool.expected == [("a",)]


def test_sources_take_strings_and_paths_and_refuse_anything_else_with_what_they_take(tmp_path):
    """``autosync.tune(None)`` or ``cluster=3`` was an AttributeError ('int' object has no attribute
    'startswith'); a ``pathlib.Path`` to a cluster YAML or a script was refused the same way."""
    from pathlib import Path

    from autosync.sources import is_trainable, load_cluster, load_model_def, load_model_spec, load_strategy_for
    from strategy_space.yaml_io import save

    with pytest.raises(ConfigError, match=r"the cluster must be local, testbed, .* or a ClusterSpec, got int 3"):
        load_cluster(3)
    for load in (load_model_def, load_model_spec):
        with pytest.raises(ConfigError, match=r"the model must be zoo:NAME.*, got NoneType None"):
            load(None)
    with pytest.raises(ConfigError, match=r"the strategy must be a strategy YAML path .*, got int 5"):
        load_strategy_for(5, SPEC, CLUSTER)
    save(CLUSTER, tmp_path / "c.yaml")
    save(STRATEGY, tmp_path / "s.yaml")
    save(SPEC, tmp_path / "m.yaml")
    assert load_cluster(tmp_path / "c.yaml") == CLUSTER
    assert load_strategy_for(tmp_path / "s.yaml", SPEC, CLUSTER) == STRATEGY
    assert load_model_spec(tmp_path / "m.yaml").variables == SPEC.variables
    assert is_trainable(Path("my_model.py:build")) and not is_trainable(tmp_path / "m.yaml")


def test_a_keras_model_object_or_the_uncalled_build_function_is_refused_saying_what_to_give():
    from autosync.sources import load_model_def, load_model_spec

    class Model:   # as keras.Model is seen here, without importing Keras
        pass

    Model.__module__ = "keras.src.models.model"

    class Sequential(Model):
        pass

    def build():
        return None

    for load in (load_model_def, load_model_spec):
        with pytest.raises(ConfigError, match=r"got Sequential .*; a Keras model object is not sent to the workers "
                                              r"\(each builds its own\): give the function that builds it as "
                                              r"autosync.ModelDef\(name=..., model_fn=..."):
            load(Sequential())
        with pytest.raises(ConfigError, match=r"got function .*; is build the function that returns the ModelDef\? "
                                              r"Call it and give its result"):
            load(build)
    with pytest.raises(ConfigError) as caught:   # neither: no hint
        load_model_def(3.5)
    assert str(caught.value).endswith("got float 3.5")


def test_the_python_api_refuses_bad_settings_before_it_starts(tmp_path):
    """The CLI refused ``--time-budget -1``; ``autosync.tune(time_budget_s=-5)`` ran a whole tuning
    run, ``store=3`` or ``warm_start=3`` was "expected str, bytes or os.PathLike object, not int",
    and ``make_trainer(timeout_s=-1)`` started Ray, loaded the model and then timed out."""
    import autosync
    from autosync.runtime.trainer import Trainer

    for kwargs, said in [({"time_budget_s": -5}, "time_budget_s must be a number of seconds > 0 or None"),
                         ({"time_budget_s": float("nan")}, "time_budget_s must be"),
                         ({"patience": 0}, "patience must be an integer >= 1"),
                         ({"steps": "3"}, r"steps must be an integer >= 1, got '3'"),   # was a TypeError
                         ({"max_steps": 0}, "max_steps must be an integer >= 1"),
                         ({"trial_timeout_s": 0}, "trial_timeout_s must be a number of seconds > 0"),
                         ({"store": 3}, r"store must be a trial store path \(a str or a path\) or None"),
                         ({"warm_start": 3}, r"warm start must be builtin, none or a trial store path .*got int 3")]:
        with pytest.raises(ConfigError, match=said):
            autosync.tune(tmp_path / "never_read.py:build", **kwargs)
    for timeout in (-1, 0, float("inf"), "60"):
        with pytest.raises(ConfigError, match=r"timeout_s must be a number of seconds > 0"):
            Trainer(_model_def(), STRATEGY, CLUSTER, timeout_s=timeout)


def test_fit_callbacks_are_checked_before_any_step_and_one_may_come_alone():
    """``fit(callbacks=5)`` was "'int' object is not iterable" and ``[5]`` "'int' object is not
    callable" after the round trip's steps had run; a Keras callback has no ``on_step_end``."""
    from autosync.runtime.fit_history import step_callbacks

    class OnStepEnd:
        def on_step_end(self, step, logs):
            pass

    fn, obj = (lambda step, logs: None), OnStepEnd()
    assert step_callbacks(()) == [] and step_callbacks([fn]) == [fn] and step_callbacks(fn) == [fn]
    assert step_callbacks([obj, fn]) == [obj.on_step_end, fn] and step_callbacks(obj) == [obj.on_step_end]
    with pytest.raises(ConfigError, match=r"callbacks must be a list of functions fn\(step, logs\) or objects with "
                                          r"on_step_end\(step, logs\), got int 5"):
        step_callbacks(5)
    with pytest.raises(ConfigError, match=r"callbacks\[1\] is neither a function fn\(step, logs\) nor an object "
                                          r"with a method on_step_end\(step, logs\): got int 5"):
        step_callbacks([fn, 5])

    class KerasLike:   # keras.callbacks.Callback's hooks are on_train_batch_end and the like
        def on_train_batch_end(self, batch, logs=None):
            pass

    with pytest.raises(ConfigError, match=r"callbacks\[0\] .*got KerasLike .*a Keras callback acts on keras.Model.fit's "
                                          r"loop.*set trainer.stop_training = True in it to stop early"):
        step_callbacks([KerasLike()])
    with pytest.raises(ConfigError, match=r"callbacks must be a list .*got str"):
        step_callbacks("on_step_end")


@pytest.mark.parametrize("name", [None, 5, "", "  ", "a\nb", "x" * 201])
def test_a_model_def_without_a_usable_name_is_refused_at_once(name):
    """``name=None`` or ``5`` reached the ModelSpec built from the workers' variables and failed
    there ('NoneType' object is not subscriptable); an empty name made reports and records of
    nothing."""
    never = lambda *a: None  # noqa: E731
    with pytest.raises(ConfigError, match=r"ModelDef name must be a non-empty printable string of at most 200 "
                                          r"characters"):
        ModelDef(name=name, model_fn=never, loss_fn=never, optimizer_fn=never, dataset_fn=never, batch_size=8)
    for fine in ("my model/v2", "x" * 200):
        assert ModelDef(name=fine, model_fn=never, loss_fn=never, optimizer_fn=never, dataset_fn=never,
                        batch_size=8).name == fine


def test_a_runner_measures_builders_names_and_files_as_make_trainer_takes_them(monkeypatch, tmp_path):
    """``runner.run(["ps", "best.yaml"])`` (or one alone) measures what those name, as
    ``make_trainer`` takes them: it raised AttributeError ('str' object has no attribute 'origin')."""
    from autosync.runtime.runner import RayRunner
    from strategy_space.builders import get_builder

    class Recording(RayRunner):
        model = SPEC   # what the workers would build

        def __init__(self):
            self.cluster, self.ran = CLUSTER, []

        def run_one(self, strategy, origin=""):
            self.ran.append((strategy, origin))
            return origin

    monkeypatch.chdir(tmp_path)
    (tmp_path / "best.yaml").write_text(STRATEGY_YAML)
    runner = Recording()
    assert runner.run(["ps", "best.yaml", STRATEGY], origins=["a", "b", "c"]) == ["a", "b", "c"]
    assert [s for s, _ in runner.ran] == [get_builder("ps").build(SPEC, CLUSTER), STRATEGY, STRATEGY]
    runner.ran.clear()
    assert runner.run("all_reduce") == ["all_reduce"]
    assert runner.ran == [(get_builder("all_reduce").build(SPEC, CLUSTER), "all_reduce")]
    with pytest.raises(ConfigError, match=r"strategy 'pss' is neither a strategy YAML file nor a builder's name"):
        runner.run(["ps", "pss"])
    with pytest.raises(ConfigError, match=r"the strategy must be a strategy YAML path .*, got int 5"):
        runner.run([5])


def test_a_strategy_path_under_home_is_read_where_it_was_found(monkeypatch, tmp_path):
    """``make_trainer(..., "~/best.yaml")``: the file was found under the home folder, then read
    unexpanded ('file not found: ~/best.yaml')."""
    from autosync.sources import load_strategy_for

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "best.yaml").write_text(STRATEGY_YAML)
    assert load_strategy_for("~/best.yaml", SPEC, CLUSTER) == STRATEGY
