"""``SearchSettings``: the knobs of the model-based tuner's rounds (``tuner.search.model_based``),
validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from strategy_space.errors import ConfigError


@dataclass(frozen=True)
class SearchSettings:
    """Knobs of one round of proposals.

    Attributes:
        batch: strategies measured per round.
        epsilon: share of each batch drawn at random from the annealing pool (exploration).
        explore_ratio: exploration draws only among candidates predicted at most this factor slower
            than the incumbent (in the figure the run ranks by): one predicted twice as slow wins
            only if the predictor is twice wrong. On the README's main job (one node) the random
            pick of every round was predicted 1.9-2.6x the incumbent and measured 1.6-1.8x the
            slowest baseline. None: the whole pool (``make_warmstart`` explores for data).
        explore_from_round: the first search round of a run that may pick at random (earlier ones
            are all greedy). Warm-start trials of the target's own group prove the predictor on what
            that group measured, not on its extrapolations: on the README's main job (ncf on one
            node, no compressed strategy in its group) round 1's random pick, stale PS with three
            fp16/PowerSGD collective groups, was predicted within 1.25x of the incumbent and
            measured 1.6x the slowest baseline. Later rounds (trust region on) open only while the
            last ran as promised.
        candidates: knowledge-guided candidates per round; the same number again uniformly random.
        chains: annealing chains, started from the best-predicted candidates.
        proposals: mutations each chain proposes per step (all chains' are scored in one call; a
            chain steps towards its best). Scored per round: chains x proposals x anneal_steps.
            Under constraints every proposal is built whole to be projected, which costs several
            times more per proposal: a quarter of them are made.
        anneal_steps: steps per chain.
        trust_radius: while the predictor is unproven on the target (module doc), candidates are at
            most this many mutations (``StrategySpace.mutate_rows``) from a measured strategy; the
            radius grows by one after each region round that beat its incumbent. 0: no trust region.
        trust_accuracy: the pairwise accuracy on the target's own trials (``Predictor.scores_``,
            cross-validated) the predictor needs to be proven (module doc).
        trust_ratio: how much slower than predicted (a factor on the gain over the incumbent) the
            last round's picks may each run for the predictor to be proven.
        trust_trials: the target's own measured trials needed before the predictor can be proven
            (its cross-validated accuracy on fewer is too noisy to open the space on: on one node,
            proven on 11 trials, it next proposed strategies 8x slower than the baselines).
        seed: random seed (an integer >= 0).

    Raises:
        ConfigError: a knob of the wrong type or out of its range (every one named, with what
            it may be).
    """

    batch: int = 4
    epsilon: float = 0.25
    explore_ratio: float | None = 1.25
    explore_from_round: int = 2
    candidates: int = 256
    chains: int = 48
    proposals: int = 64
    anneal_steps: int = 30
    trust_radius: int = 2
    trust_accuracy: float = 0.75
    trust_ratio: float = 1.5
    trust_trials: int = 12
    seed: int = 0

    def __post_init__(self):
        problems = [f"SearchSettings.{name} must be {allowed}, got {getattr(self, name)!r}"
                    for name, allowed, ok in _CHECKS if not ok(getattr(self, name))]
        if problems:
            raise ConfigError(problems)


def _int(low: int) -> Callable[[object], bool]:
    return lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= low


def _number(low: float, high: float = math.inf, *, open_low: bool = False) -> Callable[[object], bool]:
    def ok(v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
            return False
        return (v > low if open_low else v >= low) and v <= high
    return ok


# (field, what it may be, test): each knob's range is what the search can run with (a batch of
# 0 proposes nothing, forever; numpy's generators take no negative seed)
_CHECKS = (
    ("batch", "an integer >= 1", _int(1)),
    ("epsilon", "a number from 0 to 1", _number(0.0, 1.0)),
    ("explore_ratio", "None or a number > 0", lambda v: v is None or _number(0.0, open_low=True)(v)),
    ("explore_from_round", "an integer >= 1", _int(1)),
    ("candidates", "an integer >= 1", _int(1)),
    ("chains", "an integer >= 1", _int(1)),
    ("proposals", "an integer >= 1", _int(1)),
    ("anneal_steps", "an integer >= 0", _int(0)),
    ("trust_radius", "an integer >= 0", _int(0)),
    ("trust_accuracy", "a number from 0 to 1", _number(0.0, 1.0)),
    ("trust_ratio", "a number > 0", _number(0.0, open_low=True)),
    ("trust_trials", "an integer >= 0", _int(0)),
    ("seed", "an integer >= 0", _int(0)),
)
