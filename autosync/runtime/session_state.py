"""The training state of a running ``Session``, read from and written back into its actors: what a
checkpoint holds (``autosync.runtime.checkpoint`` puts it on disk).

Arrays are named for ``state.npz``: ``ps/<actor>/<var>.<shard>/<slot>`` for a parameter server's
optimizer slots, ``channel<c>/<name>`` for the state of worker channel ``c`` (all-reduced
variables' optimizer, taken from worker 0: every worker holds the same). Reads and writes happen
between round trips, when no step is in flight.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autosync.runtime.engine import Session, wait_all


@dataclass
class SessionState:
    """What ``gather`` read.

    Attributes:
        weights: worker 0's ``model.get_weights()``.
        positions: per worker (replica order), batches drawn from its data iterator.
        arrays: name -> array (see the module doc).
        ps_versions: PS actor name -> ``{"version", "chunk_version"}``.
    """

    weights: list
    positions: tuple
    arrays: dict
    ps_versions: dict


def gather(session: Session, deadline: float | None) -> SessionState:
    """Read the state of every actor of ``session``.

    Raises:
        TrialFailed: a worker or parameter server failed or died.
    """
    plan, labels = session.plan, session.actor_labels()
    states = wait_all([w.checkpoint_state.remote(i == 0) for i, w in enumerate(session.workers)], deadline,
                      "worker", list(plan.replicas), actors=labels)
    names = [p.name for p in plan.ps_actors]
    ps_states = wait_all([a.checkpoint_state.remote() for a in session.ps_actors], deadline, "parameter server",
                         names, actors=labels)
    arrays = {}
    for name, state in zip(names, ps_states):
        arrays.update({f"ps/{name}/{k}": v for k, v in state["slots"].items()})
    for c, state in enumerate(states[0]["channels"]):
        arrays.update({f"channel{c}/{k}": v for k, v in (state or {}).items()})
    return SessionState(weights=states[0]["weights"], positions=tuple(s["position"] for s in states), arrays=arrays,
                        ps_versions={n: {"version": s["version"], "chunk_version": s["chunk_version"]}
                                     for n, s in zip(names, ps_states)})


def load(session: Session, state: SessionState, values: list, step: int, deadline: float | None) -> list[str]:
    """Write ``state`` into the (freshly started) actors of ``session``.

    Args:
        state: as ``gather`` returned it, or as read from a checkpoint.
        values: every trainable variable's value (model order), sliced into the PS shards.
        step: the global step the state is at.

    Returns:
        the problems found (the state does not fit these actors); empty on success.

    Raises:
        TrialFailed: a worker or parameter server failed or died.
    """
    import ray

    plan, labels = session.plan, session.actor_labels()
    refs, problems = [], []
    for actor, p in zip(session.ps_actors, plan.ps_actors):
        counters = state.ps_versions.get(p.name)
        if counters is None:
            problems.append(f"the checkpoint has no state of parameter server {p.name}")
            continue
        prefix = f"ps/{p.name}/"
        shards = {r.key: np.ascontiguousarray(values[r.var_index][r.slicer(values[r.var_index].ndim)])
                  for r in p.shards}
        slots = {k[len(prefix):]: a for k, a in state.arrays.items() if k.startswith(prefix)}
        refs.append(actor.load_checkpoint.remote(shards, slots, counters["version"], counters["chunk_version"]))
    for found in wait_all(refs, deadline, "parameter server", None, actors=labels):
        problems += found
    used = [int(k.split("/")[0][len("channel"):]) for k in state.arrays if k.startswith("channel")]
    channels = []
    for c in range(max(used, default=-1) + 1):
        prefix = f"channel{c}/"
        channels.append({k[len(prefix):]: a for k, a in state.arrays.items() if k.startswith(prefix)} or None)
    shared = ray.put(state.weights)   # one copy in the object store for every worker
    refs = [w.restore_checkpoint.remote(shared, state.positions[i], step, channels)
            for i, w in enumerate(session.workers)]
    for found in wait_all(refs, deadline, "worker", list(plan.replicas), actors=labels):
        problems += found
    return problems
