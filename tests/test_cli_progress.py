"""The tune command's progress line says what was measured and, for a search trial, where the
search looked: near the best measured strategies (the trust region) or in the whole space."""
from __future__ import annotations

import io
from types import SimpleNamespace as NS

from autosync.cli.tune import Progress


def _line(**meta) -> str:
    out = io.StringIO()
    trial = NS(origin="search", role="search", ok=True, median=0.0195, status="ok", meta=meta)
    outcome = NS(trials=[trial] * 5, search_trials=[trial], best=NS(median=0.0125, origin="ps"))
    Progress(12, stream=out)(trial, outcome)
    return out.getvalue()


def test_a_search_trial_says_its_round_and_where_it_looked():
    line = _line(search_round=1, trust_radius=2)
    assert "search 1/12, 5 trials" in line and "best 12.5 ms (ps)" in line
    assert "last: search 19.5 ms (round 1, within 2 changes of the best)" in line
    assert "(round 3, whole space)" in _line(search_round=3, trust_radius=None)
    assert "round" not in _line()   # a trial without the search's record (a resumed old run)


def test_a_failed_probe_says_its_whole_first_line():
    """A probe that failed says why: the reason is not cut at a few words (it was at 80 characters,
    mid-sentence), only past its first line or a long limit."""
    from autosync.cli.tune import PROBE_NOTE_CHARS

    reason = ("TrialFailed: parameter server ps@node0 died (the actor process exited or was killed; "
              "node(s) host2 left the Ray cluster)")
    out = io.StringIO()
    Progress(12, stream=out).probed(NS(origin="search"), NS(source="failed", note=reason + "\nTraceback ..."))
    assert out.getvalue() == f"probe: search failed: {reason}\n"
    out = io.StringIO()
    Progress(12, stream=out).probed(NS(origin="search"), NS(source="failed", note="x" * 1000))
    assert len(out.getvalue()) == len("probe: search failed: \n") + PROBE_NOTE_CHARS and " ...\n" in out.getvalue()
