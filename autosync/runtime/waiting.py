"""Waiting for actors: ``wait_all`` gets a list of Ray refs, failing fast on the first error, at
the deadline, or (given ``alive``) once the cluster has lost a node the refs may wait on forever
(an actor pinned to a node that left is never placed); the errors a session raises.
"""
from __future__ import annotations

import time
from typing import Callable

from autosync.exception_text import error_reason, node_died, out_of_memory
from autosync.time_limit import CodeTimeout

# how often a wait that may be waiting on a lost node asks whether the cluster still has it
ALIVE_CHECK_S = 5.0


class TrialFailed(RuntimeError):
    """A session raised (a worker or PS error, a dead actor)."""


class TrialTimeout(TrialFailed):
    """A session exceeded its time limit."""


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TrialTimeout("time limit reached")
    return left


def dead_actor(e: BaseException, labels: dict[str, str]) -> str | None:
    """The label (``labels``: actor id hex -> e.g. ``parameter server ps@host1``) of the actor
    whose death caused ``e``, if it is one of them: a worker whose call to a killed parameter
    server failed names the server, not itself."""
    import re

    import ray

    stack, seen = [e], 0
    while stack and seen < 16:
        x = stack.pop()
        seen += 1
        if isinstance(x, ray.exceptions.RayActorError) and getattr(x, "actor_id", None) in labels:
            return labels[x.actor_id]
        stack += [c for c in (getattr(x, "cause", None), x.__cause__, x.__context__) if isinstance(c, BaseException)]
    text = str(e)
    for m in re.finditer(r"actor_id:?\s*([0-9a-f]{16,})", text):
        if m.group(1) in labels:
            return labels[m.group(1)]
    return None


def wait_all(refs: list, deadline: float | None, what: str, names: list | None = None,
             actors: dict[str, str] | None = None, alive: Callable[[], str] | None = None) -> list:
    """``ray.get`` of all refs, failing fast on the first error and at the deadline.

    Args:
        actors: actor id hex -> label of the actors the refs depend on; an error caused by the
            death of one of them is reported as that actor's death (``dead_actor``).
        alive: what the cluster has lost ("" while nothing), asked every ``ALIVE_CHECK_S``
            without progress (``ClusterBinding.lost_note``): the refs of actors being placed
            wait for a lost node forever, not only until the deadline.

    Raises:
        TrialFailed: one raised (its reason, prefixed by its name, or the actor that died), or
            ``alive`` said the cluster lost a node.
        TrialTimeout: not all finished before ``deadline``, or one's own limit stopped the user's
            code it ran (``time_limit.CodeTimeout``: a worker's load; its reason says where).
    """
    import ray

    index = {r: i for i, r in enumerate(refs)}
    pending = list(refs)
    results: list = [None] * len(refs)
    while pending:
        try:
            timeout = _remaining(deadline)
        except TrialTimeout:
            raise TrialTimeout(_unfinished(what, refs, pending, names, index)) from None
        if alive is not None:
            timeout = ALIVE_CHECK_S if timeout is None else min(timeout, ALIVE_CHECK_S)
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            lost = alive() if alive is not None else ""
            if lost:
                raise TrialFailed(lost)
            continue
        i = index[done[0]]
        try:
            results[i] = ray.get(done[0])
        except Exception as e:  # noqa: BLE001 - any task/actor error fails the session
            who = names[i] if names else f"#{i}"
            died = dead_actor(e, actors) if actors else None
            if died is not None:   # (an awaited actor's own death is not one it "lost")
                lost = "" if died == f"{what} {who}" else f"; {what} {who} lost it"
                how = out_of_memory(str(e)) or node_died(str(e)) or "the actor process exited or was killed"
                raise TrialFailed(f"{died} died ({how}{lost})") from None
            if isinstance(e, CodeTimeout) or isinstance(getattr(e, "cause", None), CodeTimeout):
                # its user code hung, stopped short of the limit (``time_limit``): a time-out that says where
                raise TrialTimeout(f"{what} {who} stopped: {error_reason(e)}") from None
            raise TrialFailed(f"{what} {who} failed: {error_reason(e)}") from None
    return results


def _unfinished(what: str, refs: list, pending: list, names: list | None, index: dict) -> str:
    """What a wait past its deadline says: how many did not finish, and which (the first 8)."""
    said = f"{what}: time limit reached with {len(pending)} of {len(refs)} unfinished"
    if not names:
        return said
    which = [f"{what} {names[index[r]]}" for r in pending]
    return f"{said} ({', '.join(which[:8])}{', ...' if len(which) > 8 else ''})"
