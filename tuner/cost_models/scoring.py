"""What the annealer scores chains of mutations with (``tuner.search.annealing``): the
``ChainScorer`` protocol and its implementations. ``IncrementalScorer`` gives a predictor's seconds
from features updated from each chain's (``tuner.features.incremental``), without featurizing every
variable of every proposal; ``PerLosslessStep`` turns another scorer's seconds per step into
seconds per step of lossless progress, so the chains climb goodput.
"""
from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from strategy_space.encoding import EncodedStrategies, Mutation

from tuner.features.incremental import IncrementalFeaturizer


class ChainScorer(Protocol):
    """Scores chains of mutations, in seconds (lower is better):

    * ``reset(e)``: the chains' strategies (one per row); their seconds.
    * ``propose(m)``: a ``Mutation`` of the chains' current strategies (proposal i varies chain
      ``m.parents[i]``); the proposals' seconds.
    * ``accept(chosen)``: per chain, the proposal it moves to, or -1 where it stays.
    """

    def reset(self, e: EncodedStrategies) -> np.ndarray: ...

    def propose(self, m: Mutation) -> np.ndarray: ...

    def accept(self, chosen: np.ndarray) -> None: ...


class IncrementalScorer:
    """Predicted seconds of annealing proposals: features updated from the chains'
    (``IncrementalFeaturizer``), then a predictor on feature rows.

    Args:
        featurizer: built on the (model, cluster) tables, with the parameters the predictor's
            features use.
        predict: feature rows (``features.batch.featurize``'s columns) -> seconds, e.g.
            ``LearnedSimulator.predict``.
    """

    def __init__(self, featurizer: IncrementalFeaturizer, predict: Callable[[np.ndarray], np.ndarray]):
        self.featurizer = featurizer
        self.predict = predict

    def reset(self, e: EncodedStrategies) -> np.ndarray:
        return self.predict(self.featurizer.reset(e))

    def propose(self, m: Mutation | EncodedStrategies) -> np.ndarray:
        return self.predict(self.featurizer.propose(m))

    def accept(self, chosen: np.ndarray) -> None:
        self.featurizer.accept(chosen)


class PerLosslessStep:
    """A ChainScorer in seconds per step of lossless progress: another scorer's seconds per step
    divided by an estimated statistical efficiency of each strategy (``tuner.records.goodput``), so the
    chains climb goodput, not step time alone. The efficiency is computed on whole proposals
    (O(proposals x V) per step, like a constrained search's projection).

    Args:
        inner: the step-time scorer (e.g. an IncrementalScorer).
        efficiency: a batch of strategies -> (B,) efficiencies in (0, 1].
    """

    def __init__(self, inner: ChainScorer, efficiency: Callable[[EncodedStrategies], np.ndarray]):
        self.inner, self.efficiency = inner, efficiency

    def reset(self, e: EncodedStrategies) -> np.ndarray:
        return self.inner.reset(e) / self.efficiency(e)

    def propose(self, m: Mutation) -> np.ndarray:
        return self.inner.propose(m) / self.efficiency(m.encoded)

    def accept(self, chosen: np.ndarray) -> None:
        self.inner.accept(chosen)
