"""The baselines as a Tuner: every registered builder's strategy, once (projected onto the user's
pins). ``tune_loop`` measures them first; builders that produce the same strategy share one proposal
(measured once, reported under each name).
"""
from __future__ import annotations

from typing import Sequence

from strategy_space.builders import BUILDERS, get_builder

from .base import Proposal, Tuner
from .trial import Trial

# appended to a baseline's name when the constraints changed its builder's strategy
PINNED_SUFFIX = "+pins"


class BaselineTuner(Tuner):
    """Proposes each builder's strategy once; ``has_next`` is False once every one was proposed
    (``next_batch(k)`` hands out ``k`` at a time, all at once by default). A builder whose
    strategy the constraints change is named ``NAME+pins`` (what is measured is not NAME's
    strategy any more). Builders already measured (``update``, e.g. by a resumed run) are skipped.
    """

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.done: set[str] = set()
        self._given: set[str] = set()   # origins handed out by next_batch

    def proposals(self) -> list[Proposal]:
        """Every builder's strategy, builders with the same strategy sharing one proposal."""
        out: dict[str, Proposal] = {}
        for name in BUILDERS:
            enc = self.space.encode([get_builder(name).build(self.model, self.cluster)])
            if self.constraints is not None and self.constraints.changes(enc, self.space)[0]:
                name = f"{name}{PINNED_SUFFIX}"
            projected = self.project(enc)
            strategy = self.space.decode(projected, 0, origin=name)
            key = self.canonical_key(strategy)
            if key in out:
                out[key].aliases += (name,)
            else:
                out[key] = Proposal(strategy, name, encoded=projected)
        return list(out.values())

    def next_batch(self, k: int | None = None) -> list[Proposal]:
        """The baselines not measured yet (all of them at once when ``k`` is None)."""
        pending = [p for p in self.proposals() if p.origin not in self.done]
        out = pending if k is None else pending[:k]
        self._given |= {p.origin for p in out}
        return out

    def has_next(self) -> bool:
        """Whether a baseline was neither proposed nor measured yet."""
        return any(p.origin not in self.done | self._given for p in self.proposals())

    def update(self, trials: Sequence[Trial]) -> None:
        super().update(trials)
        self.done |= {t.origin for t in trials}
