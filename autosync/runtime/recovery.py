"""How ``Trainer.fit`` recovers from failures: a dead or failed worker or parameter server is
started again from the last checkpoint (``max_failures``, as Ray Train's ``FailureConfig``), and,
with ``elastic``, a node that left the Ray cluster is done without: the strategy is re-placed on
the nodes left (``strategy_space.shrink``) and training goes on there from the last checkpoint,
re-cut for the re-placed strategy and the smaller number of workers (``reshard``), as Horovod's
elastic mode goes on with the workers that remain.
"""
from __future__ import annotations

import dataclasses
import time

from autosync.exception_text import NODE_DIED
from autosync.runtime import data_parts
from autosync.runtime.binding import ClusterBinding
from autosync.runtime.engine import TrialFailed, WorkerPool
from strategy_space import validate
from strategy_space.errors import ConfigError
from strategy_space.shrink import without_nodes
from tuner.records.trial import lost_nodes_note

# after a failure, how long a worker may take to answer before it is started again (a worker
# blocked on a killed parameter server notices within psnet.LIVENESS_S)
SALVAGE_S = 6.0
# an actor Ray says died with its node: how long Ray may take to report the node dead (its
# health checks) before the failure is taken for an ordinary one
NODE_DEATH_S = 30.0


class Recovery:
    """``Trainer``'s recovery from failures (a mixin: it uses the trainer's session, pool, plan,
    strategy, cluster, data parts, ``_start`` and ``_restore``)."""

    def _guarded(self, work, store, failures: list, max_failures: int, history, first: int,
                 elastic: bool = False) -> None:
        """Run ``work``; on a worker or PS failure, kill what is left and, while failures stay
        within ``max_failures``, start again from the checkpoint in ``store`` (without the nodes
        that left the cluster, with ``elastic``)."""
        moved = None   # ("replaced" or "without", the lost nodes, stand-ins): how an elastic recovery goes on
        failed = time.monotonic()   # when the last failure was caught (a restart says how long it took)
        while True:
            restarting = self.session is None
            try:
                if restarting:   # the previous attempt failed: start again
                    failed_at = self.step
                    self._start()
                    manifest = self._restore(store, time.monotonic() + self.timeout_s)
                    history.truncate(manifest.step - first)
                    restart = {"failed_at": failed_at, "resumed_from": manifest.step, "error": failures[-1],
                               "seconds": round(time.monotonic() - failed, 3)}
                    if moved:
                        restart.update({moved[0]: moved[1]}, workers=len(self.plan.replicas),
                                       strategy=self.strategy.fingerprint)
                        if moved[2]:
                            restart["stand_ins"] = moved[2]   # {node: the address of the Ray node standing in}
                        if self._parts:   # the global batch kept: the data parts each worker draws
                            restart["parts"] = [list(p) for p in self._parts]
                    history.restarts.append(restart)
                    return
                return work()
            except ConfigError as e:
                if not moved:   # (a restart on the same nodes restores what it saved itself)
                    raise
                self._salvage()
                raise RuntimeError(f"training failed {len(failures)} time{'s' if len(failures) > 1 else ''}, and "
                                   f"cannot go on {moved[0]} {', '.join(moved[1])}: {e}: {'; '.join(failures)}") from e
            except TrialFailed as e:
                if not max_failures:
                    if self.session is not None:
                        self.session.abort()
                        self.session = None
                    raise
                self._salvage()
                # a node this strategy places actors on has left: no restart could place them (a
                # restart that failed is given Ray's report too: its actors may have waited for a node
                # whose workers' deaths did not say it died, the commonest way a lost machine shows)
                gone = self._lost_nodes(NODE_DIED in str(e) or restarting)
                if not (restarting and gone and failures):   # (else the failure it restarted from, again)
                    failed = time.monotonic()
                    failures.append(f"at step {self.step}: {e}")
                times = f"{len(failures)} time{'s' if len(failures) > 1 else ''}"
                listed = "; ".join(failures)
                if len(failures) > max_failures or (gone and not elastic):
                    why = (f"and cannot restart: {lost_nodes_note(*gone)} (or fit with elastic=True to go on "
                           f"without them)" if gone and not elastic else f"more than max_failures={max_failures}")
                    raise RuntimeError(f"training failed {times}, {why}: {listed}") from e
                if gone:
                    try:
                        moved = self._go_on_without()
                    except ConfigError as refused:
                        raise RuntimeError(f"training failed {times}, and cannot go on without "
                                           f"{', '.join(gone[0])}: {refused}: {listed}") from e

    def _lost_nodes(self, wait: bool) -> tuple[list[str], bool] | None:
        """The lost nodes this trainer's strategy needs (``ClusterBinding.lost_for``); with ``wait``
        (an actor died with its node, or a restart failed), Ray is given up to ``NODE_DEATH_S`` to
        report it, so that a restart is not spent on placing actors on a node that is gone, unless
        every node the strategy uses answers meanwhile (``ClusterBinding.answering``): none is lost,
        and the failure is an ordinary one."""
        until = time.monotonic() + (NODE_DEATH_S if wait else 0.0)
        used = None
        while True:
            gone = self.pool.binding.lost_for(self.strategy)
            if gone or time.monotonic() >= until:
                return gone
            if used is None:
                used = {s.rsplit(":", 1)[0] for s in self.strategy.resolved_replicas(self.cluster)}
                used |= set(self.strategy.ps_nodes())
            if self.pool.binding.answering(sorted(used)):
                return None
            time.sleep(0.5)

    def _go_on_without(self) -> tuple[str, list[str], dict]:
        """After the loss of nodes the strategy uses: where a Ray node with each lost node's label
        (or address) has joined since, or one that stands in for it (``_bound``), the same strategy
        on a pool bound to them; else the strategy re-placed on the nodes left, with a pool bound
        to those. The next start restores the last checkpoint there. Returns ``("replaced", nodes,
        stand-ins)`` or ``("without", nodes, {})``.

        Raises:
            ConfigError: it cannot go on without them (no worker left, or the re-placed strategy
                does not fit the nodes left: ``validate``'s problems).
        """
        lost = self.pool.binding.lost_nodes()
        try:   # a replacement has joined (an autoscaler's, a restarted node): everything as it was
            binding, cluster, standing = self._bound(self.cluster)
            strategy, how = self.strategy, "replaced"
        except ConfigError:
            strategy, cluster = without_nodes(self.strategy, self.cluster, self.model_spec, lost)
            validate(strategy, self.model_spec, cluster)
            binding, how, standing = ClusterBinding.bind(cluster), "without", {}
            if self.keep_global_batch:   # the workers left draw the lost ones' batches too
                self._parts = data_parts.assign(list(self.strategy.resolved_replicas(self.cluster)), self._parts,
                                                list(strategy.resolved_replicas(cluster)))
        self._move_to(binding, strategy, cluster)
        return how, lost, standing

    def _bound(self, cluster) -> tuple[ClusterBinding, object, dict]:
        """``(binding, cluster, stand-ins)``: ``cluster`` bound to the Ray nodes it names, or, where
        some have left, to Ray nodes that joined since this fit began standing in for them
        (``ClusterBinding.stand_ins``: an autoscaler's replacements, new addresses), ``cluster``
        then with their addresses, and ``{node: address}`` of the stand-ins.

        Raises:
            ConfigError: a node is gone and none stands in for it.
        """
        try:
            return ClusterBinding.bind(cluster), cluster, {}
        except ConfigError:
            found = self.pool.binding.stand_ins(cluster)
            if found is None:
                raise
            return ClusterBinding.bind(found[0]), found[0], found[1]

    def _take_back(self, store, history) -> None:
        """At a checkpoint of an elastic fit that went on without nodes: where every node of the
        cluster it was given is in the Ray cluster again (back, or replaced), go on on all of them
        under the strategy it was given, from the checkpoint just written (as Horovod's elastic
        mode takes in hosts its discovery finds)."""
        strategy, cluster, parts = self._given
        if self.cluster.node_names == cluster.node_names or self.session is None:
            return
        try:
            binding, cluster, standing = self._bound(cluster)
        except ConfigError:   # not all back yet
            return
        began, back = time.monotonic(), [n for n in cluster.node_names if n not in self.cluster.node_names]
        session, self.session = self.session, None
        session.close(clean=True)
        self._move_to(binding, strategy, cluster)
        self._parts = parts
        self._start()
        manifest = self._restore(store, time.monotonic() + self.timeout_s)
        history.restarts.append({"back": back, "resumed_from": manifest.step, "workers": len(self.plan.replicas),
                                 "strategy": self.strategy.fingerprint, "seconds": round(time.monotonic() - began, 3),
                                 **({"stand_ins": standing} if standing else {})})

    def _move_to(self, binding: ClusterBinding, strategy, cluster) -> None:
        """Train with ``strategy`` on ``cluster`` from now on, on a new pool of workers bound by
        ``binding`` (started by the next ``_start``)."""
        # every actor of the old pool goes, a lent one's too (its owner starts them again when it
        # needs them): a survivor would hold the CPUs of its node that the new pool's workers ask for
        self.pool.kill_all()
        binding = dataclasses.replace(binding, seen=self.pool.binding.seen)   # what joined since the fit began
        self.pool, self.strategy, self.cluster = WorkerPool(binding), strategy, cluster
        self._new_pool = True   # the trainer's own now, whoever lent the first

    def _salvage(self) -> None:
        """After a failure: kill the session's parameter servers and helpers, and the workers
        that are dead or still busy after ``SALVAGE_S`` (a worker waiting on a killed parameter
        server fails within ``psnet.LIVENESS_S``). Survivors stay warm (no new TensorFlow
        import) only in plans without collectives, whose groups would have to form again."""
        import ray

        session, self.session = self.session, None
        if session is None:
            self.pool.kill_all()
            return
        session.close()
        if self.plan.backends or not session.workers:
            self.pool.kill_all()
            return
        refs = [w.info.remote() for w in session.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=SALVAGE_S)
        lost = []
        for slot, ref in zip(self.plan.replicas, refs):
            try:
                if ref not in ready:
                    raise TimeoutError
                ray.get(ref)
            except Exception:  # noqa: BLE001 - dead or stuck: started again
                lost.append(slot)
        self.pool.kill(lost)
