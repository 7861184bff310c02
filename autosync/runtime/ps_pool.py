"""Parameter-server actors kept alive across sessions, per node, as ``WorkerPool`` keeps workers.

A fresh PS actor starts in a fraction of a second with the numpy optimizer rules, but one that
runs the model's own Keras optimizer (``keras_optimizer``) imports TensorFlow first: seconds per
trial. So a ``Session`` takes its PS actors from this pool and ``reset``s them onto its plan's
shards (every piece of state is made anew: shards, optimizer, counters, the data-plane socket);
after a clean session it gives them back (``release`` drops that session's state first, so an idle
actor holds no view of the object store and no socket). An actor of a session that failed, was
aborted or timed out is killed, never kept; so is one whose ``release`` does not answer at once.

Size: idle actors per node never exceed the most a plan asked for on that node (a session gives
back exactly what it took); ``kill_all`` kills every one, idle or not. Keras is imported in an
idle actor only for a session whose optimizer needs it (``prepare``, fired without waiting so the
import overlaps what the driver does meanwhile, e.g. restarting workers).
"""
from __future__ import annotations

import gc
import sys
import time

from autosync.runtime.lean_import import skip_keras_extras

# a clean session's actors answer ``release`` at once; one that does not is killed instead
RELEASE_S = 10.0
# whether this process froze the objects alive after its first Keras session (``PooledShard._drop``)
_FROZEN = False


class PSPool:
    """Idle parameter-server actors per node, and the ones lent to a session.

    Args:
        binding: where the nodes are (``ClusterBinding``).
        actor_class: the PS actor's class (``ps_shard.ParameterServerShard``, a ``PooledShard``).
    """

    def __init__(self, binding, actor_class):
        self.binding = binding
        self.actor_class = actor_class
        self.idle: dict[str, list] = {}   # node -> idle actors
        self.lent: dict = {}              # actor id hex -> (node, actor), taken by a running session
        self.with_keras: set[str] = set()   # actor ids hex that imported Keras (or were asked to)
        self.most: dict[str, int] = {}    # node -> the most actors one session took there

    def __len__(self) -> int:
        return sum(len(a) for a in self.idle.values()) + len(self.lent)

    def _new(self, node: str, args: tuple = ()):
        import ray

        cls = ray.remote(self.actor_class)
        return cls.options(**self.binding.actor_options(node), max_concurrency=1000).remote(*args)

    def prepare(self, nodes, keras: bool) -> None:
        """Make sure idle actors are there for a session with a PS actor on each of ``nodes`` (one
        entry per actor) and, when its optimizer runs through Keras, that they import it now;
        returns without waiting (a failure shows in the session's ``take``)."""
        counts: dict[str, int] = {}
        for node in nodes:
            counts[node] = counts.get(node, 0) + 1
        for node, n in counts.items():
            idle = self.idle.setdefault(node, [])
            while len(idle) < n:
                idle.append(self._new(node))
            for actor in idle[:n] if keras else ():
                key = actor._actor_id.hex()
                if key not in self.with_keras:
                    actor.preload.remote()
                    self.with_keras.add(key)

    def expect(self, model_def, nodes) -> bool:
        """Before the workers first load ``model_def``: an idle actor on each of ``nodes`` starts
        now, beside the workers' own start, instead of on the first session's path once they have
        loaded (``prepare`` then finds it there); and if the optimizer runs through Keras on a
        parameter server, it imports Keras meanwhile as well. That is known only where this process
        has imported Keras already (the commands and the Trainer build the optimizer here to check
        it before Ray starts): the driver never imports it for this. Returns whether the actors
        import Keras.

        (Measured by ``benchmarks/runtime_overhead.py --pool-startup``.)"""
        # a node the cluster lacks is the strategy's validation's to report, after the load
        nodes = sorted({n for n in nodes if self.binding is None or n in self.binding.keys})
        keras = False
        if nodes and "keras" in sys.modules:
            from autosync.runtime.optimizers import keras_optimizer_config, numpy_rules

            try:
                keras = not numpy_rules(keras_optimizer_config(model_def.optimizer_fn()))
            except Exception:  # noqa: BLE001 - the workers' load reports what is wrong with optimizer_fn
                keras = False
        self.prepare(nodes, keras)
        return keras

    def start(self, plan, optimizer: dict, chunks: list, description_ref) -> tuple[list, list]:
        """The PS actors of ``plan`` (its order) set up with their shards (see ``take``).

        Args:
            optimizer: the model's ``keras_optimizer_config``.
            chunks: per PS actor of the plan, its keys' chunks (``ParameterServerShard``).
            description_ref: the pool's description in the object store (the initial values).

        Returns:
            ``(actors, refs)``: each ref resolves to its actor's ``ready`` facts.
        """
        from autosync.runtime.optimizers import numpy_rules

        keras, out = not numpy_rules(optimizer), []
        for p, c in zip(plan.ps_actors, chunks):
            # each actor slices its shards from the pool's copy of the initial values (no new copy)
            shards = {r.key: (r.var_index, r.start, r.stop, r.axis) for r in p.shards}
            out.append(self.take(p.node, (p.name, shards, [r.key for r in p.shards if r.sparse],
                                          [r.key for r in p.shards if r.local_replication], optimizer,
                                          plan.num_workers, plan.sync, c, description_ref), keras))
        return [a for a, _ in out], [r for _, r in out]

    def take(self, node: str, args: tuple, keras: bool) -> tuple:
        """An actor on ``node`` holding the shards that ``args`` (``ParameterServerShard``'s
        arguments) describe: an idle one reset onto them (one that imported Keras first when
        ``keras``), else a new one.

        Returns:
            ``(actor, ref)``: ``ref`` resolves to the actor's ``ready`` facts once it holds them.
        """
        idle = self.idle.get(node, [])
        ranked = sorted(idle, key=lambda a: (a._actor_id.hex() in self.with_keras) != keras)
        if ranked:
            actor = ranked[0]
            idle.remove(actor)
            ref = actor.reset.remote(*args)
        else:
            actor = self._new(node, args)
            ref = actor.ready.remote()
        if keras:
            self.with_keras.add(actor._actor_id.hex())
        self.lent[actor._actor_id.hex()] = (node, actor)
        self.most[node] = max(self.most.get(node, 0), sum(n == node for n, _ in self.lent.values()))
        return actor, ref

    def give_back(self, actors) -> None:
        """Keep the actors of a clean session for the next one; each is ``release``d first, and
        one that fails to (an error left in it, unapplied pushes, dead, slow) is killed."""
        import ray

        actors = [a for a in actors if a._actor_id.hex() in self.lent]
        refs = [a.release.remote() for a in actors]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=RELEASE_S) if refs else ([], [])
        for actor, ref in zip(actors, refs):
            node, _ = self.lent.pop(actor._actor_id.hex())
            try:
                if ref not in done:
                    raise TimeoutError
                ray.get(ref)
            except Exception:  # noqa: BLE001 - any failure: never reused
                self._kill(actor)
                continue
            idle = self.idle.setdefault(node, [])
            if len(idle) < self.most.get(node, 0):
                idle.append(actor)
            else:
                self._kill(actor)

    def kill(self, actors) -> None:
        """Kill ``actors`` (taken by a session that failed), never to be reused."""
        for actor in actors:
            self.lent.pop(actor._actor_id.hex(), None)
            self._kill(actor)

    def _kill(self, actor) -> None:
        import ray

        self.with_keras.discard(actor._actor_id.hex())
        ray.kill(actor, no_restart=True)

    def kill_all(self) -> None:
        """Kill every actor of the pool, idle or lent."""
        self.kill([a for _, a in self.lent.values()] + [a for idle in self.idle.values() for a in idle])
        self.idle, self.lent, self.with_keras = {}, {}, set()


class PooledShard:
    """What a pooled ``ParameterServerShard`` does between sessions (its ``_setup`` makes a
    session's state, ``ready`` says where it runs)."""

    async def reset(self, *args, **kwargs) -> dict:
        """Hold a new session's shards (the arguments of ``__init__``), from scratch: nothing of an
        earlier session stays (values, optimizer and its slots, counters, pending pushes, kept rows,
        shared objects, the data-plane socket: ``listen`` opens a new one). Returns ``ready``'s facts."""
        skip_keras_extras()   # (an actor's process: a Keras optimizer imports Keras in ``_setup``)
        self._drop()
        self._setup(*args, **kwargs)
        return await self.ready()

    async def release(self) -> None:
        """Drop a finished session's state, so an idle pooled actor holds none of it (no view of
        the object store, no socket).

        Raises:
            RuntimeError: the session failed here or left pushes unapplied (the pool then kills
                this actor instead of keeping it).
        """
        if self._error or getattr(self, "_pending", None):
            raise RuntimeError(self._error or f"{self.name}: released with steps still being pushed")
        self._drop()

    async def preload(self) -> float:
        """Import Keras (and TensorFlow) now, before a session whose optimizer needs it; returns
        the seconds it took (0 when already imported)."""
        if "keras" in sys.modules:
            return 0.0
        from autosync.tflog import quiet_startup

        t0 = time.perf_counter()
        skip_keras_extras()   # Keras' scikit-learn, matplotlib and pandas integrations: 2.3 s of this import
        quiet_startup()
        import keras  # noqa: F401

        return time.perf_counter() - t0

    def _drop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self.params, self.optimizer, self._shared, self._asked, self._pending = {}, None, {}, {}, {}
        self._cond, self._error, self.name = None, None, ""
        if "keras" in sys.modules:   # the Keras optimizer's names and graphs of the last session
            import keras

            keras.utils.clear_session()   # (its gc.collect: 0.2 s over TensorFlow's ~400k objects)
            global _FROZEN
            if not _FROZEN:
                # Everything alive now is TensorFlow's and Keras' own (the session's state is gone):
                # frozen, the next sessions' collections scan only what those sessions made (0.2 s
                # -> ~0 per ``reset`` and ``release``). Frozen objects still go when unreferenced.
                gc.freeze()
                _FROZEN = True
