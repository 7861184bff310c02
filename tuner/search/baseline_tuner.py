"""The baselines as a Tuner: every registered builder's strategy, once (projected onto the user's
pins). ``tune_loop`` measures them first; builders that produce the same strategy share one proposal
(measured once, reported under each name).
"""
from __future__ import annotations

from strategy_space.builders import BUILDERS, get_builder

from tuner.records.history import History
from tuner.search.base import Proposal, Tuner

# appended to a baseline's name when the constraints changed its builder's strategy
PINNED_SUFFIX = "+pins"


class BaselineTuner(Tuner):
    """Proposes each builder's strategy once; ``has_next`` is False once every one was proposed
    (``next_batch(k)`` hands out ``k`` at a time, all at once by default). A builder whose
    strategy the constraints change is named ``NAME+pins`` (what is measured is not NAME's
    strategy any more). Builders already measured (under their name, in the history, e.g. of a
    resumed run) are skipped.
    """

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._given: set[str] = set()   # origins handed out by next_batch
        self._proposals: list[Proposal] | None = None   # built (and encoded) once

    def proposals(self) -> list[Proposal]:
        """Every builder's strategy, builders with the same strategy sharing one proposal."""
        if self._proposals is None:
            self._proposals = self._build_proposals()
        return list(self._proposals)

    def _build_proposals(self) -> list[Proposal]:
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

    def next_batch(self, k: int | None, history: History) -> list[Proposal]:
        """The baselines not measured yet (all of them at once when ``k`` is None)."""
        done = {t.origin for t in history}
        pending = [p for p in self.proposals() if p.origin not in done]
        out = pending if k is None else pending[:k]
        self._given |= {p.origin for p in out}
        return out

    def has_next(self) -> bool:
        """Whether a baseline was not proposed yet."""
        return any(p.origin not in self._given for p in self.proposals())
