"""What the model's own optimizer lets a search propose.

The runtime refuses some strategies under some optimizers, before any parameter server starts:
- a variable split into shards updated separately, under ``clipnorm`` or an optimizer whose rule
  reads whole variables (Lamb, Adafactor, Muon): ``runtime.keras_optimizer.whole_variable_reasons``;
- staleness or an asynchronous parameter server under ``global_clipnorm``: ``check_global_clipnorm``;
- a variable with a constraint (``kernel_constraint=NonNeg()``) anywhere but the graph all-reduce,
  the one synchronizer that applies it: ``check_constraints``; such a variable is pinned there.

A search that proposed them would spend its trials on refusals (seen: two of three search trials
of a model with ``clipnorm`` failed so). ``tune`` and ``plan`` therefore keep every searched
strategy inside what the runtime accepts: one shard per variable (a pin before the user's own,
``tuner.search.constraints``), no staleness. The pin also holds for a variable all-reduced in the
graph, where Keras would clip the whole variable itself: the space cannot say "one shard where
updated outside the graph", and partitioning an all-reduced variable rarely pays.

The builders' baselines are measured as their builders make them: a refused one is recorded as
failed with the runtime's reason, which is what a user choosing it by hand would meet.

The optimizer is the one the recommendation will train with (``target_optimizer``): under emulated
compute of a trainable model that is the model's own, not the emulated one its trials apply.
"""
from __future__ import annotations

from dataclasses import dataclass

from autosync.models.apart import Taken
from strategy_space import ModelSpec
from strategy_space.errors import ConfigError, listed_names
from tuner.search.constraints import Constraints, Rule

# built_model_optimizer's result (or what it raises) taken along by profiled_with_pins, per ModelDef
_PINNED = Taken()


@dataclass(frozen=True)
class SearchLimits:
    """The search's pins under a model's optimizer.

    Attributes:
        constraints: the user's constraints with the optimizer's pins before them (None: neither).
        partition_note: why no variable is partitioned ("" when partitioning is free).
        staleness_note: why staleness is not proposed ("" when it may be).
        constraint_note: which variables are kept on the graph all-reduce for their constraint.
    """

    constraints: Constraints | None
    partition_note: str = ""
    staleness_note: str = ""
    constraint_note: str = ""

    @property
    def search_note(self) -> str:
        """What the search keeps out, for a run's summary ("" when nothing)."""
        return "; ".join(n for n in (self.partition_note, self.constraint_note) if n)

    @property
    def staleness_ok(self) -> bool:
        """Whether staleness and asynchronous parameter servers may be proposed."""
        return not self.staleness_note


def target_optimizer(model, compute: str, runner) -> dict:
    """The optimizer config a recommendation will train with: what the runner's trials apply
    (``Runner.optimizer_config``), except under emulated compute of a trainable model, whose trials
    apply the emulated optimizer (``--optimizer``) while training applies the model's own.

    Raises:
        ConfigError: see ``RayRunner.model``, or a model whose own optimizer the runtime refuses
            (``check_model_optimizer``).
    """
    from autosync.sources import is_trainable, load_model_def

    compute = getattr(runner, "compute", compute)
    if compute == "emulated" and is_trainable(model):
        return built_model_optimizer(load_model_def(model))[1]
    return runner.optimizer_config()


def built_model_optimizer(model_def) -> tuple:
    """``(ModelSpec, optimizer config)`` of a trainable model, its model built here once: the
    config with the model's variables (``check_model_optimizer``), so that it names those whose
    constraints pin them (``search_limits``) where no worker builds the model (``plan``, emulated
    compute). The optimizer is checked before the model is built; a large model is built in a
    process of its own (``models.apart``).

    Raises:
        ConfigError: see ``check_model_optimizer`` and ``model_spec_from_def``.
    """
    from autosync.models import apart
    from autosync.runtime.optimizers import check_model_optimizer

    taken = _PINNED.get(model_def)
    if taken is not None:
        if isinstance(taken[1], ConfigError):
            raise taken[1]
        return taken
    check_model_optimizer(model_def)
    return apart.read(_built_here, model_def)


def profiled_with_pins(model_def, workers: int) -> ModelSpec:
    """``profile.profiled_model_spec`` of ``model_def``, and ``built_model_optimizer``'s config
    from the same build, kept for it (this ModelDef object): emulated compute's ``tune`` asks for
    both, and for the probe key of ``workers``, which a large model's child takes along
    (``training_key.read_with_digest``): one build, one process.

    Raises:
        ConfigError: see ``profiled_model_spec`` (what ``built_model_optimizer`` would raise is
            raised when it is asked).
    """
    from autosync.models.training_key import read_with_digest

    spec, config = read_with_digest(_profiled_pinned, model_def, (), workers)
    _PINNED.put(model_def, (spec, config))
    return spec


def _profiled_pinned(model_def) -> tuple:
    from autosync.models.profile import profiled_built
    from autosync.runtime.optimizers import check_model_optimizer

    spec, model = profiled_built(model_def)
    try:   # (what the runtime refuses is said where the pins are asked for: emulated trials apply their own)
        return spec, check_model_optimizer(model_def, model.trainable_variables, model)
    except ConfigError as e:
        return spec, e


def _built_here(model_def) -> tuple:
    from autosync.models.ingest import built_model_spec
    from autosync.runtime.optimizers import check_model_optimizer

    spec, model = built_model_spec(model_def)[:2]
    return spec, check_model_optimizer(model_def, model.trainable_variables, model)


def search_limits(optimizer_config: dict, user: Constraints | None = None, sparse=None) -> SearchLimits:
    """The pins that keep a search inside what the runtime runs under ``optimizer_config``
    (``keras_optimizer_config``; empty for a runner that has none to say). ``sparse``: the
    model's sparse variables' names, which a rule's ``sparse`` selects by (None: unknown, and
    such a rule is taken to select every variable its ``match`` does).

    Raises:
        ConfigError: a user's pin the runtime would refuse under this optimizer (shards above 1
            under ``clipnorm``, staleness under ``global_clipnorm``), saying which and what to change.
    """
    from autosync.runtime.keras_optimizer import whole_variable_reasons
    from autosync.runtime.loss_scale import LOSS_SCALE
    from autosync.runtime.optimizer_config import CONSTRAINED

    rules = tuple(user.rules) if user is not None else ()
    constrained = sorted(optimizer_config.get(CONSTRAINED) or {})
    pinned, problems = _constrained_pins(constrained, rules, sparse)
    staleness = user.staleness if user is not None else None
    partition_note = staleness_note = ""
    reasons = [reason for reason, _ in whole_variable_reasons(optimizer_config)]
    if reasons:
        why = "; ".join(reasons)
        problems += [f"{rule.label}: pins shards {rule.shards}, but {why}, which shards updated separately cannot "
                     f"do; pin shards 1 or leave shards free" for rule in rules if (rule.shards or 1) > 1]
        rules = (Rule(shards=1),) + rules
        partition_note = f"no variable partitioned: {why}, which shards updated separately cannot do"
    clip = optimizer_config.get("global_clipnorm")
    held = ("the optimizer's global_clipnorm" if clip is not None else
            "the optimizer's dynamic loss scaling" if optimizer_config.get(LOSS_SCALE) is not None else None)
    if held is not None:
        if staleness:
            problems.append(f"constraints: pin staleness {staleness}, but {held}{f'={clip!r}' if clip is not None else ''} "
                            f"needs every gradient of a step before any update; pin staleness 0 or leave it free")
        staleness_note = f"staleness and asynchronous PS not proposed: {held} needs every gradient of a step before any update"
    if problems:
        raise ConfigError(problems)
    constraints = Constraints(pinned + rules, staleness) if reasons or pinned else user
    constraint_note = (f"kept whole on the graph all-reduce, which alone applies their constraints: "
                       f"{listed_names(constrained)}" if constrained else "")
    return SearchLimits(constraints, partition_note, staleness_note, constraint_note)


def _constrained_pins(constrained: list[str], rules: tuple, sparse) -> tuple[tuple, list[str]]:
    """Pins that keep each of the ``constrained`` variables on the graph all-reduce, whole: the one
    synchronizer that applies their constraints (``keras_optimizer.check_constraints``); and the
    problems of the user's rules that would move one elsewhere (``search_limits``' ``sparse``)."""
    import glob

    def selects(rule, name: str) -> bool:
        return (rule.selects(name, name in sparse) if sparse is not None
                else rule.selects(name, True) or rule.selects(name, False))

    problems = []
    for rule in rules:
        moves = [what for what, bad in (("sync ps", rule.sync == "ps"),
                                        (f"backend {rule.backend}", rule.backend not in (None, "graph")),
                                        (f"shards {rule.shards}", (rule.shards or 1) > 1)) if bad]
        problems += [f"{rule.label}: pins {', '.join(moves)} on {name}, which has a constraint that only the graph "
                     f"all-reduce applies (Keras applies it after each update); leave {name} free or pin sync "
                     f"all_reduce, backend graph" for name in constrained
                     if moves and selects(rule, name)]
    return tuple(Rule(match=glob.escape(name), sync="all_reduce", backend="graph", shards=1)
                 for name in constrained), problems
