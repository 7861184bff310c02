"""The Tuner interface (AutoTVM's): ``next_batch`` proposes strategies to measure, ``update`` takes
what was measured, ``has_next`` says whether there is anything left to propose. ``tune_loop``
(``tuner.tuning``) drives any Tuner; the implementations are ``ModelBasedTuner``
(``tuner.model_based``), ``BaselineTuner`` (``tuner.baseline_tuner``) and ``RandomTuner``
(``tuner.random_tuner``).

A ``Proposal`` carries its strategy's encoded row (``EncodedStrategies`` of one strategy, or None
for a strategy outside the encoded space), so what was proposed is never encoded again.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

from strategy_space import ClusterSpec, ConfigError, ModelSpec, Strategy
from strategy_space.encoding import EncodedStrategies
from strategy_space.space import StrategySpace

from .constraints import CompiledConstraints, Constraints
from .measurements import Measurements
from .trial import Trial


@dataclass
class Proposal:
    """A strategy to measure.

    Attributes:
        strategy: what to run.
        origin: who proposed it (a builder name, ``search``, ``explore``, ``random``).
        predicted_s: the step time the tuner predicted, when it predicts.
        aliases: other builders that produce the same strategy.
        encoded: the strategy as one encoded row, when it is in the encoded space.
    """

    strategy: Strategy
    origin: str
    predicted_s: float | None = None
    aliases: tuple[str, ...] = ()
    encoded: EncodedStrategies | None = None


class Tuner(abc.ABC):
    """Proposes strategies of one (model, cluster) and learns from their measurements.

    Every tuner knows what was measured (so it never proposes a strategy again, nor one that runs
    identically: ``Strategy.canonical``) and projects what it proposes onto the user's pins. What
    was measured is kept once, in ``measurements`` (``tune_loop`` hands the tuner its run's record,
    ``TuneOutcome.trials``); the tuner keeps only indexes into it.

    Args:
        model, cluster: the target.
        constraints: user pins (never violated).
        batch_size: proposals ``tune_loop`` asks for per round.
        lossless: propose no lossy part (no compressor; parameter servers synchronous with
            staleness 0): the ``exact`` quality (``tuner.goodput``).
        staleness, allow_async: the parameter-server modes offered besides synchronous with
            staleness 0 (``StrategySpace``); ignored when ``lossless``.

    Attributes:
        measurements: the trials measured so far, in order (its own record until ``tune_loop``
            gives it the run's).
        measured_canonical: canonical fingerprints of everything measured.
        efficiency: strategy fingerprint -> measured statistical efficiency of the lossy
            strategies probed so far (``tune_loop`` hands the tuner its run's,
            ``TuneOutcome.efficiency``); a tuner may rank by it.
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
        self.measurements = Measurements()
        self.efficiency: dict = {}
        self._row_keys: dict[str, bytes | None] = {}   # strategy fingerprint -> its encoded key
        # canonical fingerprints of everything measured: strategies that differ only in fusion-group
        # numbering or in a rotation over identical nodes are one strategy (``Strategy.canonical``)
        self.measured_canonical: set[str] = set()

    @abc.abstractmethod
    def next_batch(self, k: int) -> list[Proposal]:
        """Up to ``k`` strategies to measure next (never one measured before); empty when exhausted."""

    def has_next(self) -> bool:
        """Whether ``next_batch`` may still propose something."""
        return True

    def update(self, trials: Sequence[Trial]) -> None:
        """Take measured trials (this run's, in measurement order): recorded in ``measurements``
        unless that record holds them already, and indexed."""
        self.measurements.add(trials)
        for t in trials:
            self.measured_canonical.add(self.canonical_key(t.strategy))
            if t.strategy.fingerprint not in self._row_keys:
                self._row_keys[t.strategy.fingerprint] = self.row_key(t.strategy)

    @property
    def measured(self) -> dict[bytes, float]:
        """Encoded key -> seconds of its latest measurement (inf: failed), read from
        ``measurements`` (trials outside the encoded space have no key)."""
        return self.measurements.latest_seconds(lambda t: self._row_keys.get(t.strategy.fingerprint))

    def load_history(self, groups) -> None:
        """Trials measured before this run, as (model, cluster, trials) groups (read once from the
        store at start). A tuner that learns from them overrides this; the default ignores them."""

    def project(self, e: EncodedStrategies) -> EncodedStrategies:
        """``e`` with the user's pins applied (unchanged without constraints)."""
        return self.constraints.apply(e, self.space) if self.constraints is not None else e

    def canonical_key(self, strategy: Strategy) -> str:
        """Equal for strategies that run identically (see ``Strategy.canonical``)."""
        return strategy.canonical(self.cluster).fingerprint

    def row_key(self, strategy: Strategy) -> bytes | None:
        """The encoded key of ``strategy`` (None outside the encodable space, or another model's)."""
        try:
            return self.space.encode([strategy]).row_keys()[0]
        except (ConfigError, KeyError):
            return None
