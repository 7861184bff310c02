"""``sync.base.across_collective``: which channel sets have a worker issue its next pulls before
the step's collective (the order itself is held by the runtime's equivalence tests of mixed
parameter-server and all-reduce strategies, which train as one process does)."""
from __future__ import annotations

from autosync.runtime.sync.base import across_collective


class _Channel:
    def __init__(self, splits_pull=False, in_graph=False):
        self.splits_pull, self.in_graph = splits_pull, in_graph


PS, AR, GRAPH = _Channel(splits_pull=True), _Channel(), _Channel(in_graph=True)


def test_pulls_go_before_a_collective_only_beside_a_parameter_server_and_an_after_step_collective():
    assert across_collective([PS, AR]) and across_collective([AR, PS]) and across_collective([PS, GRAPH, AR])
    # nothing to wait behind: parameter servers alone, or collectives inside the training step
    assert not across_collective([PS]) and not across_collective([PS, PS]) and not across_collective([PS, GRAPH])
    # nothing to issue early: no channel whose pull comes back later
    assert not across_collective([AR]) and not across_collective([AR, GRAPH]) and not across_collective([])
