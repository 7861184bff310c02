"""Random search as a Tuner: uniformly random strategies of the encoded space (projected onto the
user's pins), never one measured before nor one that runs like a measured one. The baseline to
beat for any model-based search (AutoTVM's ``RandomTuner``)."""
from __future__ import annotations

import numpy as np

from strategy_space.memory import fits_encoded

from tuner.records.history import History
from tuner.search.base import Proposal, Tuner


class RandomTuner(Tuner):
    """Args: as ``Tuner``, plus ``seed`` for the draws and ``tries``: draws per proposal asked for
    (a draw equivalent to a measured strategy is dropped)."""

    def __init__(self, *a, seed: int = 0, tries: int = 4, **k):
        super().__init__(*a, **k)
        self.rng = np.random.default_rng(seed)
        self.tries = tries

    def next_batch(self, k: int, history: History) -> list[Proposal]:
        e = self.project(self.space.sample_encoded(self.rng, self.tries * max(k, 1)))
        e = e.take(np.flatnonzero(fits_encoded(e, self.model, self.cluster)))   # none that cannot fit a node
        keys = e.row_keys()
        seen_keys, seen = set(history.latest_seconds()), history.canonical_keys()
        out = []
        for i in range(len(e)):
            if len(out) >= k:
                break
            strategy = self.space.decode(e, i, origin="random")
            canon = self.canonical_key(strategy)
            if keys[i] in seen_keys or canon in seen:
                continue
            seen_keys.add(keys[i])
            seen.add(canon)
            out.append(Proposal(strategy, "random", encoded=e.take([i])))
        return out
