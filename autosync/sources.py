"""Resolve the ``--model`` and ``--cluster`` arguments every command accepts.

Models:
    ``zoo:NAME[?size=small|full][&batch_size=N]``  a built-in model (trainable);
    ``path/to/script.py:function``           the user's code returning a ModelDef (trainable);
    ``model.yaml``                           a ModelSpec only (simulation; cannot train).
Clusters:
    ``local``      the embedded default: one Ray node on this machine;
    ``testbed``    the emulated multi-node cluster started by ``autosync testbed up``;
    ``ray``        the Ray cluster at ``$RAY_ADDRESS``, described by Ray (``autosync.ray_cluster``);
    ``file.yaml``  a ClusterSpec.
"""
from __future__ import annotations

import os

from autosync.host_memory import machine_memory_gib
from strategy_space import ClusterSpec, ModelSpec, NodeSpec
from strategy_space.errors import ConfigError
from strategy_space.yaml_io import load

# the README's model forms, word for word (tests/test_cli_hardening.py holds the two together)
ZOO_FORM = "zoo:NAME[?size=small|full][&batch_size=N]"
MODEL_FORMS = f"{ZOO_FORM}, path/to/script.py:function, or a model-spec YAML file"
TRAINABLE_FORMS = f"{ZOO_FORM} or path/to/script.py:function"
CLUSTER_FORMS = "local, testbed, ray[?workers=N] (the Ray cluster at RAY_ADDRESS), or a cluster-spec YAML file"

LOCAL_WORKERS = 2


def local_cluster(workers: int | None = None) -> ClusterSpec:
    """The embedded default: one node on this machine with ``workers`` training replicas
    (default 2) sharing its CPUs and its memory (what strategies must fit: ``strategy_space.memory``)."""
    cpus = os.cpu_count() or 1
    return ClusterSpec(
        name="local",
        nodes=(NodeSpec(name="node0", address="127.0.0.1", cpus=cpus, workers=workers or LOCAL_WORKERS,
                        chief=True, bandwidth_gbps=10.0, memory_gib=machine_memory_gib()),),
    )


def _testbed_cluster() -> ClusterSpec:
    from autosync.testbed import state

    return state.load_cluster_spec()


BUILTIN_CLUSTERS = {"local": local_cluster, "testbed": _testbed_cluster}


def _text(value, what: str, forms: str, hint=None) -> str:
    """A source given as a string or a path (``pathlib.Path``) as a string; ``hint(value)``: what
    the message adds for a value given by mistake.

    Raises:
        ConfigError: anything else (an int, None, a Keras model), saying what is taken.
    """
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if isinstance(text, str):
            return text
    said = hint(value) if hint is not None else ""
    raise ConfigError(f"{what} must be {forms}, got {type(value).__name__} {value!r:.80}{said}")


def _model_hint(value) -> str:
    """What to give instead of a model object the workers cannot build from (a Keras model), or of
    the function that returns the ModelDef (not called)."""
    if any(c.__name__ == "Model" and c.__module__.startswith("keras") for c in type(value).__mro__):
        return ("; a Keras model object is not sent to the workers (each builds its own): give the "
                "function that builds it as autosync.ModelDef(name=..., model_fn=..., loss_fn=..., optimizer_fn=..., "
                "dataset_fn=..., batch_size=...) (docs/models.md)")
    if callable(value) and not isinstance(value, type):
        name = getattr(value, "__name__", "it")
        return f"; is {name} the function that returns the ModelDef? Call it and give its result"
    return ""


def load_cluster(text: str | ClusterSpec) -> ClusterSpec:
    """A ClusterSpec from a built-in name, ``ray[?options]`` or a YAML path.

    Raises:
        ConfigError: unknown name, missing file or invalid spec.
    """
    if isinstance(text, ClusterSpec):
        return text
    text = _text(text, "the cluster", f"{CLUSTER_FORMS} (a str or a path), or a ClusterSpec")
    if text in BUILTIN_CLUSTERS:
        return BUILTIN_CLUSTERS[text]()
    from autosync.ray_cluster import is_ray_cluster, ray_cluster

    if is_ray_cluster(text):
        return ray_cluster(text)
    if text.endswith((".yaml", ".yml")) or os.path.sep in text:
        return load(text, "cluster")  # type: ignore[return-value]
    raise ConfigError(f"unknown cluster {text!r}; give {CLUSTER_FORMS}")


def _split_script(text: str) -> tuple[str, str] | None:
    path, sep, fn = text.rpartition(":")
    if sep and path.endswith(".py") and fn.isidentifier():
        return path, fn
    return None


def is_trainable_source(text: str) -> bool:
    return text.startswith("zoo:") or _split_script(text) is not None


def is_trainable(model) -> bool:
    """Whether ``model`` (a ModelDef, a source string, a ModelSpec, ...) has code that trains."""
    from autosync.model_def import ModelDef

    text = os.fspath(model) if isinstance(model, os.PathLike) else model
    return isinstance(model, ModelDef) or isinstance(text, str) and is_trainable_source(text)


def load_model_def(text):
    """A trainable ModelDef from ``zoo:NAME`` or ``script.py:function`` (a ModelDef passes through).

    Raises:
        ConfigError: unknown zoo name, bad script, or a spec-only YAML (which cannot train).
    """
    from autosync.model_def import ModelDef

    if isinstance(text, ModelDef):
        return text
    text = _text(text, "the model", f"{TRAINABLE_FORMS} (a str or a path), or an autosync.ModelDef", _model_hint)
    if text.startswith("zoo:"):
        from autosync.models import zoo

        return zoo.get_model_def(text[len("zoo:"):])
    script = _split_script(text)
    if script:
        from autosync.models import script as script_loader

        return script_loader.load_model_def(*script)
    if text.endswith((".yaml", ".yml")):
        raise ConfigError(
            f"{text} is a model spec (YAML): it describes variables for simulation but holds no code, so it "
            f"cannot be trained or run; use zoo:NAME or path/to/script.py:function to train"
        )
    raise ConfigError(f"unknown model {text!r}; give {MODEL_FORMS}")


def load_model_spec(text, *, profile: bool = False) -> ModelSpec:
    """A ModelSpec from any model source; ``profile`` measures the compute time (trainable
    sources only; a YAML spec keeps the profile it has).

    Raises:
        ConfigError: as for ``load_model_def``, or an invalid YAML spec.
    """
    from autosync.model_def import ModelDef

    if isinstance(text, ModelSpec):
        return text
    if not isinstance(text, ModelDef):
        text = _text(text, "the model", f"{MODEL_FORMS} (a str or a path), an autosync.ModelDef or a ModelSpec",
                     _model_hint)
    if isinstance(text, str) and text.endswith((".yaml", ".yml")) and not is_trainable_source(text):
        return load(text, "model")  # type: ignore[return-value]
    model_def = load_model_def(text)
    from autosync.models import ingest, profile as profiling

    return profiling.profiled_model_spec(model_def) if profile else ingest.model_spec_from_def(model_def)


def load_emulated_model(text, step_time_s: float | None = None):
    """What emulated compute runs from any model source: a ModelSpec (an EmulatedModelDef or a
    ModelSpec passes through). A trainable model's compute time is measured unless
    ``step_time_s`` gives it; a YAML spec keeps the profile it has.

    Raises:
        ConfigError: as for ``load_model_spec``.
    """
    from autosync.runtime.emulated import EmulatedModelDef

    if isinstance(text, (ModelSpec, EmulatedModelDef)):
        return text
    yaml_spec = isinstance(text, (str, os.PathLike)) and os.fspath(text).endswith((".yaml", ".yml"))
    return load_model_spec(text, profile=step_time_s is None and not yaml_spec)


def builtin_cluster_names() -> list[str]:
    return sorted(BUILTIN_CLUSTERS)


def load_strategy_for(strategy, model, cluster: ClusterSpec):
    """A Strategy given as itself, as a strategy YAML path, or as a builder's name (``ps``,
    ``all_reduce``, ...: the strategy that builder makes for ``model`` (a ModelDef or a ModelSpec)
    and ``cluster``, as ``autosync build`` writes it; a file of that name wins).

    Raises:
        ConfigError: see ``strategy_space.builders.resolve_strategy``.
    """
    from strategy_space.builders import resolve_strategy

    def spec() -> ModelSpec:
        if isinstance(model, ModelSpec):
            return model
        from autosync.models.ingest import model_spec_from_def

        return model_spec_from_def(model)

    return resolve_strategy(strategy, spec, cluster)
