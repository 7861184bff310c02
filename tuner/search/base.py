"""The Tuner interface (AutoTVM's, read as Optuna's samplers read ``study.trials``):
``next_batch(k, history)`` proposes strategies to measure after reading what was measured (a
``History``, ``tuner.records.history``, which the loop owns and appends each trial to), ``has_next`` says
whether there is anything left to propose. ``tune_loop`` (``tuner.search.tuning``) drives any Tuner; the
implementations are ``ModelBasedTuner`` (``tuner.search.model_based``), ``BaselineTuner``
(``tuner.search.baseline_tuner``) and ``RandomTuner`` (``tuner.search.random_tuner``).

A ``Proposal`` carries its strategy's encoded row (``EncodedStrategies`` of one strategy, or None
for a strategy outside the encoded space) and, when the tuner computed it, its feature row; the
History takes both over when the trial arrives, so what was proposed is never encoded or
featurized again.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

import numpy as np

from strategy_space import ClusterSpec, ModelSpec, Strategy
from strategy_space.encoding import EncodedStrategies
from strategy_space.space import StrategySpace

from tuner.records.history import History
from tuner.search.constraints import CompiledConstraints, Constraints


@dataclass
class Proposal:
    """A strategy to measure.

    Attributes:
        strategy: what to run.
        origin: who proposed it (a builder name, ``search``, ``explore``, ``random``).
        predicted_s: the step time the tuner predicted, when it predicts.
        aliases: other builders that produce the same strategy.
        encoded: the strategy as one encoded row, when it is in the encoded space.
        features: the strategy's feature row (``features.batch.featurize``), when the tuner computed it.
        meta: facts about the proposal the trial keeps in its ``meta`` (e.g. the search round and
            trust region it came from).
    """

    strategy: Strategy
    origin: str
    predicted_s: float | None = None
    aliases: tuple[str, ...] = ()
    encoded: EncodedStrategies | None = None
    features: np.ndarray | None = field(default=None, compare=False, repr=False)
    meta: dict = field(default_factory=dict, compare=False)


class Tuner(abc.ABC):
    """Proposes strategies of one (model, cluster), reading what was measured from the History
    it is given (so it never proposes a strategy again, nor one that runs identically:
    ``Strategy.canonical``), and projects what it proposes onto the user's pins.

    Args:
        model, cluster: the target.
        constraints: user pins (never violated).
        batch_size: proposals ``tune_loop`` asks for per round.
        lossless: propose no lossy part (no compressor; parameter servers synchronous with
            staleness 0): the ``exact`` quality (``tuner.records.goodput``).
        staleness, allow_async: the parameter-server modes offered besides synchronous with
            staleness 0 (``StrategySpace``); ignored when ``lossless``.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, *, constraints: Constraints | None = None,
                 batch_size: int = 4, lossless: bool = False, staleness: tuple[int, ...] = (0,),
                 allow_async: bool = False):
        self.model, self.cluster = model, cluster
        self.pins = constraints
        self.batch_size = batch_size
        self.lossless = lossless
        self.space = (StrategySpace(model, cluster, compressors=("none",)) if lossless else
                      StrategySpace(model, cluster, staleness=tuple(staleness), allow_async=allow_async))
        self.constraints: CompiledConstraints | None = constraints.compile(self.space) if constraints else None

    @abc.abstractmethod
    def next_batch(self, k: int | None, history: History) -> list[Proposal]:
        """Up to ``k`` strategies to measure next, none measured before (``history``: the run's
        trials so far, which the tuner reads and never changes); empty when exhausted."""

    def has_next(self) -> bool:
        """Whether ``next_batch`` may still propose something."""
        return True

    def load_groups(self, groups) -> None:
        """Trials measured before this run, as (model, cluster, trials) groups (read once from the
        store at start; this run's trials come in the ``History``). A tuner that learns from them
        overrides this; the default ignores them."""

    def project(self, e: EncodedStrategies) -> EncodedStrategies:
        """``e`` with the user's pins applied (unchanged without constraints)."""
        return self.constraints.apply(e, self.space) if self.constraints is not None else e

    def canonical_key(self, strategy: Strategy) -> str:
        """Equal for strategies that run identically (see ``Strategy.canonical``)."""
        return strategy.canonical(self.cluster).fingerprint
