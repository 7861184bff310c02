"""``Trainer.fit``'s recovery decisions (``autosync.runtime.recovery.Recovery``) on fakes, without
Ray: when a lost node ends the fit, when an elastic fit goes on without it, what it says when it
cannot. The real thing, a node removed from a Ray cluster mid-fit, is in
``tests/test_runtime_multinode.py``."""
from __future__ import annotations

import dataclasses
import types

import pytest

from autosync.runtime import binding as binding_module, recovery
from autosync.runtime.binding import ClusterBinding
from autosync.runtime.fit_history import History
from autosync.runtime.waiting import TrialFailed
from strategy_space import ClusterSpec, ConfigError, NodeSpec
from strategy_space.builders import get_builder
from tests.fakes import tiny_model

MODEL = tiny_model()
CLUSTER = ClusterSpec("c", (NodeSpec("a", address="10.0.0.1", workers=1),
                            NodeSpec("b", address="10.0.0.2", workers=1),
                            NodeSpec("p", address="10.0.0.3", workers=0)))


@dataclasses.dataclass(frozen=True)
class Binding(ClusterBinding):
    """A binding whose nodes are lost as ``reports`` says, one entry per question (the last stays)."""

    reports: list = dataclasses.field(default_factory=list)
    answers: list = dataclasses.field(default_factory=list)   # the nodes asked, when they answer (else empty)

    def lost_nodes(self):
        return self.reports.pop(0) if len(self.reports) > 1 else self.reports[0]

    def answering(self, nodes):
        if self.answers:
            self.answers.append(list(nodes))
        return bool(self.answers)


class FakeTrainer(recovery.Recovery):
    def __init__(self, strategy, reports, keep_global_batch=False):
        self.strategy, self.cluster, self.model_spec = strategy, CLUSTER, MODEL
        self.keep_global_batch, self._parts = keep_global_batch, None
        self.pool = self._pool(CLUSTER, reports)
        self.session, self.step, self.timeout_s = types.SimpleNamespace(abort=lambda: None), 5, 60.0
        self._own_pool, self._new_pool, self.killed = True, False, 0
        self.plan = None
        self._given = (strategy, CLUSTER, None)

    def _pool(self, cluster, reports):
        return types.SimpleNamespace(binding=Binding(cluster, {}, {}, reports=reports), kill_all=self._kill)

    def _kill(self):
        self.killed += 1

    def _salvage(self):
        self.session = None

    def _start(self):
        self.session = "started"
        self.started_parts = self._parts   # what the new session's workers draw
        self.plan = types.SimpleNamespace(replicas=self.strategy.resolved_replicas(self.cluster))

    def _restore(self, store, deadline):
        return types.SimpleNamespace(step=3)


SEEN = frozenset(n.name for n in CLUSTER.nodes)   # the Ray node ids alive when the fit began


def _ray_node(node_id: str, address: str, cpus: float = 4.0, label: str | None = None) -> dict:
    """A ``ray.nodes()`` entry."""
    return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": True,
            "Resources": {f"node:{address}": 1.0, "CPU": cpus, **({label: 1.0} if label else {})}}


def fails(message: str):
    def work():
        raise TrialFailed(message)
    return work


@pytest.fixture
def no_ray(monkeypatch):
    """The pools an elastic recovery binds, without Ray: ``present`` is what Ray has alive (the
    nodes a lost one is not among, unless a test says a replacement joined); ``made`` the
    clusters bound."""
    state = types.SimpleNamespace(made=[], present={"a", "p"}, joined=[])

    def bind(cluster):
        missing = [n.name for n in cluster.nodes if n.name not in state.present and n.address not in state.joined]
        if missing:
            raise ConfigError(f"requested Ray resource for {missing}")
        state.made.append(cluster.node_names)
        return ClusterBinding(cluster, {}, {})

    def stand_ins(binding, cluster):   # Ray's alive nodes: the present ones and those that joined
        alive = [_ray_node(n.name, n.address) for n in CLUSTER.nodes if n.name in state.present]
        return binding_module.stand_ins(cluster, alive + [_ray_node(f"new{i}", a) for i, a in enumerate(state.joined)],
                                        SEEN)
    monkeypatch.setattr(recovery.ClusterBinding, "bind", staticmethod(bind))
    monkeypatch.setattr(recovery.ClusterBinding, "stand_ins", stand_ins)
    monkeypatch.setattr(recovery, "WorkerPool", lambda binding: types.SimpleNamespace(binding=binding,
                                                                                      kill_all=lambda: None))
    return state


def test_an_elastic_fit_waits_for_ray_to_report_a_dead_node_then_goes_on_without_it(no_ray, monkeypatch):
    monkeypatch.setattr(recovery, "NODE_DEATH_S", 5.0)
    monkeypatch.setattr(recovery.time, "sleep", lambda s: None)
    strategy = get_builder("partitioned_ps", min_partition_bytes=1).build(MODEL, CLUSTER)
    # Ray reports the node dead only at the third question (after the actor's death surfaced)
    trainer = FakeTrainer(strategy, [[], [], ["b"]])
    failures, history = [], History(loss=[0.0] * 5, step_times=[0.0] * 5, wall_times=[0.0] * 5)
    trainer._guarded(fails("worker b:0 died (its node left the Ray cluster)"), None, failures, 2, history, 0,
                     elastic=True)
    assert no_ray.made == [("a", "p")] and trainer.killed == 1
    assert trainer.cluster.node_names == ("a", "p") and "b" not in trainer.strategy.ps_nodes()
    assert trainer._new_pool
    (restart,) = history.restarts
    assert restart["without"] == ["b"] and restart["workers"] == 1 and restart["resumed_from"] == 3
    assert restart["strategy"] == trainer.strategy.fingerprint != strategy.fingerprint
    assert len(history.loss) == 3


def test_a_lost_node_replaced_by_a_ray_node_of_its_label_is_taken_as_it_was(no_ray):
    strategy = get_builder("partitioned_ps", min_partition_bytes=1).build(MODEL, CLUSTER)
    trainer = FakeTrainer(strategy, [["b"]])
    no_ray.present.add("b")   # an autoscaler's new node, with b's resource label
    failures, history = [], History()
    trainer._guarded(fails("worker b:0 died (its node left the Ray cluster)"), None, failures, 1, history, 0,
                     elastic=True)
    assert no_ray.made == [CLUSTER.node_names] and trainer.killed == 1 and trainer._new_pool
    assert trainer.strategy is strategy and trainer.cluster is CLUSTER
    (restart,) = history.restarts
    assert restart["replaced"] == ["b"] and restart["workers"] == 2 and "without" not in restart


def test_an_ordinary_failure_does_not_wait_for_a_node_and_restarts_where_it_was(no_ray):
    strategy = get_builder("partitioned_ps", min_partition_bytes=1).build(MODEL, CLUSTER)
    trainer = FakeTrainer(strategy, [[]])
    failures, history = [], History()
    trainer._guarded(fails("worker b:0 died (the actor process exited or was killed)"), None, failures, 1,
                     history, 0, elastic=True)
    assert no_ray.made == [] and trainer.strategy is strategy and "without" not in history.restarts[0]


@pytest.mark.parametrize("reports, elastic, allowed, said", [
    ([["b"]], False, 3, r"training failed 1 time, and cannot restart: node\(s\) b left the Ray cluster .* \(or fit "
                        r"with elastic=True to go on without them\): at step 5: boom"),
    ([["a", "b"]], True, 3, r"training failed 1 time, and cannot go on without a, b: without node\(s\) a, b cluster c "
                            r"has no worker left.*: at step 5: boom"),
    ([["b"]], True, 0, r"^boom$"),   # no recovery asked for: the failure itself
])
def test_a_lost_node_that_cannot_be_done_without_ends_the_fit_saying_why(no_ray, reports, elastic, allowed, said):
    strategy = get_builder("partitioned_ps", min_partition_bytes=1).build(MODEL, CLUSTER)
    trainer = FakeTrainer(strategy, reports)
    with pytest.raises((RuntimeError, TrialFailed), match=said):
        trainer._guarded(fails("boom"), None, [], allowed, History(), 0, elastic=elastic)
    assert no_ray.made == []


def test_an_elastic_fit_takes_its_nodes_back_at_a_checkpoint_once_all_are_in_ray_again(no_ray):
    strategy = get_builder("partitioned_ps", min_partition_bytes=1).build(MODEL, CLUSTER)
    trainer = FakeTrainer(strategy, [["b"]])
    history = History()
    trainer._guarded(fails("worker b:0 died (its node left the Ray cluster)"), None, [], 2, history, 0, elastic=True)
    assert trainer.cluster.node_names == ("a", "p")
    closed = []
    trainer.session = types.SimpleNamespace(close=lambda clean: closed.append(clean))
    trainer._take_back(None, history)   # b is not back: nothing changes
    assert trainer.cluster.node_names == ("a", "p") and closed == []
    no_ray.present.add("b")
    trainer._take_back(None, history)
    assert closed == [True] and trainer.strategy is strategy and trainer.cluster is CLUSTER
    assert no_ray.made[-1] == CLUSTER.node_names and trainer.session == "started"
    back = history.restarts[-1]
    assert back["back"] == ["b"] and back["workers"] == 2 and back["resumed_from"] == 3 and "error" not in back
    trainer._take_back(None, history)   # on the cluster it was given: nothing to take back
    assert len(history.restarts) == 2 and len(no_ray.made) == 2


def test_keeping_the_global_batch_the_workers_left_draw_the_lost_ones_parts_until_they_are_back(no_ray):
    strategy = get_builder("partitioned_ps", min_partition_bytes=1).build(MODEL, CLUSTER)
    trainer = FakeTrainer(strategy, [["b"]], keep_global_batch=True)
    history = History()
    trainer._guarded(fails("worker b:0 died (its node left the Ray cluster)"), None, [], 2, history, 0, elastic=True)
    assert trainer.cluster.node_names == ("a", "p") and trainer.started_parts == [(0, 1)]
    assert history.restarts[0]["parts"] == [[0, 1]] and history.restarts[0]["workers"] == 1
    trainer.session = types.SimpleNamespace(close=lambda clean: None)
    no_ray.present.add("b")
    trainer._take_back(None, history)
    assert trainer.cluster is CLUSTER and trainer.started_parts is None and "parts" not in history.restarts[-1]


def test_without_elastic_a_node_death_ends_the_fit_once_ray_reports_it_not_after_a_restart(no_ray, monkeypatch):
    monkeypatch.setattr(recovery.time, "sleep", lambda s: None)
    strategy = get_builder("partitioned_ps", min_partition_bytes=1).build(MODEL, CLUSTER)
    trainer = FakeTrainer(strategy, [[], [], ["b"]])   # reported at the third question
    with pytest.raises(RuntimeError, match=r"training failed 1 time, and cannot restart: node\(s\) b left"):
        trainer._guarded(fails("worker b:0 died (its node left the Ray cluster)"), None, [], 3, History(), 0)


def test_a_checkpoint_the_nodes_left_cannot_restore_ends_an_elastic_fit_saying_why(no_ray):
    strategy = get_builder("partitioned_ps", min_partition_bytes=1).build(MODEL, CLUSTER)
    trainer = FakeTrainer(strategy, [["b"]])

    def refuse(store, deadline):
        raise ConfigError("restore ck: the checkpoint of an asynchronous PS is not re-cut")
    trainer._restore = refuse
    with pytest.raises(RuntimeError, match=r"training failed 1 time, and cannot go on without b: restore ck: the "
                                           r"checkpoint of an asynchronous PS is not re-cut: at step 5: worker b:0"):
        trainer._guarded(fails("worker b:0 died (its node left the Ray cluster)"), None, [], 2, History(), 0,
                         elastic=True)
    assert trainer.session is None



def test_a_ray_node_that_joined_since_stands_in_for_a_lost_one_found_by_its_address(no_ray):
    """An autoscaler's replacement comes with a new address: it stands in for the lost node (the same
    strategy, the node's name kept, its address the new one), and the restart says so."""
    strategy = get_builder("partitioned_ps", min_partition_bytes=1).build(MODEL, CLUSTER)
    trainer = FakeTrainer(strategy, [["b"]])
    no_ray.joined.append("10.0.0.9")
    history = History()
    trainer._guarded(fails("worker b:0 died (its node left the Ray cluster)"), None, [], 1, history, 0, elastic=True)
    assert trainer.strategy is strategy and trainer.cluster.node_names == CLUSTER.node_names
    assert trainer.cluster.node("b").address == "10.0.0.9" and trainer.cluster.node("a").address == "10.0.0.1"
    (restart,) = history.restarts
    assert restart["replaced"] == ["b"] and restart["stand_ins"] == {"b": "10.0.0.9"} and restart["workers"] == 2
    trainer.session = types.SimpleNamespace(close=lambda clean: None)
    trainer._take_back(None, history)   # every node of the cluster it was given is there: nothing to take back
    assert len(history.restarts) == 1


def test_an_elastic_fit_takes_a_stand_in_back_at_a_checkpoint(no_ray):
    strategy = get_builder("partitioned_ps", min_partition_bytes=1).build(MODEL, CLUSTER)
    trainer = FakeTrainer(strategy, [["b"]])
    history = History()
    trainer._guarded(fails("worker b:0 died (its node left the Ray cluster)"), None, [], 1, history, 0, elastic=True)
    assert trainer.cluster.node_names == ("a", "p")   # none had joined: without b
    trainer.session = types.SimpleNamespace(close=lambda clean: None)
    no_ray.joined.append("10.0.0.7")
    trainer._take_back(None, history)
    assert trainer.strategy is strategy and trainer.cluster.node("b").address == "10.0.0.7"
    assert history.restarts[-1]["back"] == ["b"] and history.restarts[-1]["stand_ins"] == {"b": "10.0.0.7"}


def test_stand_ins_are_nodes_that_joined_since_with_room_for_the_lost_nodes_workers():
    alive = [_ray_node("a", "10.0.0.1"), _ray_node("p", "10.0.0.3"),
             _ray_node("old", "10.0.0.4"),              # alive when the fit began: some other use
             _ray_node("small", "10.0.0.5", cpus=0.5),  # joined, but too small for b's worker
             _ray_node("late", "10.0.0.8"), _ray_node("new", "10.0.0.6")]
    shaped = dataclasses.replace(CLUSTER, nodes=tuple(dataclasses.replace(n, cpus=2) for n in CLUSTER.nodes))
    seen = SEEN | {"old"}
    cluster, moved = binding_module.stand_ins(shaped, alive, seen)
    assert moved == {"b": "10.0.0.6"} and cluster.node("b").address == "10.0.0.6"   # the lowest address that fits
    assert [n.address for n in cluster.nodes if n.name != "b"] == ["10.0.0.1", "10.0.0.3"]
    # two nodes gone, one stand-in: none; nothing gone: none
    assert binding_module.stand_ins(shaped, [n for n in alive if n["NodeID"] != "a" and n["NodeID"] != "late"],
                                    seen) is None
    assert binding_module.stand_ins(shaped, alive + [_ray_node("b", "10.0.0.2")], seen) is None
    # a node found by its resource label: its replacement carries the label, nothing stands in for it
    labelled = dataclasses.replace(CLUSTER, nodes=tuple(dataclasses.replace(n, resource=f"host_{n.name}")
                                                        for n in CLUSTER.nodes))
    assert binding_module.stand_ins(labelled, [_ray_node("x", "10.0.0.9", label="host_a")], seen) is None


@pytest.mark.parametrize("elastic", [True, False])
def test_a_restart_that_fails_on_a_node_found_lost_is_the_same_failure_not_another(no_ray, monkeypatch, elastic):
    """A machine that dies shows first as its workers' deaths ("the actor process exited or was
    killed"), before Ray's heartbeats mark the node dead: the restart's actors then wait for it and
    are cancelled. That is the failure it restarted from, not a second one: max_failures=1 is enough
    to go on without the node (elastic), or the fit ends saying the node left (found on a testbed)."""
    monkeypatch.setattr(recovery, "NODE_DEATH_S", 5.0)
    monkeypatch.setattr(recovery.time, "sleep", lambda s: None)
    strategy = get_builder("partitioned_ps", min_partition_bytes=1).build(MODEL, CLUSTER)
    # not lost at the failure, nor at once when the restart fails: Ray reports it a question later
    trainer = FakeTrainer(strategy, [[], [], ["b"]])
    starts = []

    def start():
        starts.append(trainer.cluster.node_names)
        if len(starts) == 1:
            raise TrialFailed("worker b:0 failed: The actor never ran - it was cancelled before it started running.")
        FakeTrainer._start(trainer)
    trainer._start = start
    history, failures = History(), []
    work = fails("worker b:0 died (the actor process exited or was killed)")
    if not elastic:
        with pytest.raises(RuntimeError, match=r"training failed 1 time, and cannot restart: node\(s\) b left"):
            trainer._guarded(work, None, failures, 1, history, 0)
        return
    trainer._guarded(work, None, failures, 1, history, 0, elastic=True)
    assert starts == [CLUSTER.node_names, ("a", "p")] and len(failures) == 1
    (restart,) = history.restarts
    assert restart["without"] == ["b"] and restart["error"].endswith("(the actor process exited or was killed)")


def test_a_failure_is_taken_for_an_ordinary_one_at_once_where_every_node_answers(no_ray, monkeypatch):
    """A restart that failed for an ordinary reason (the nodes all there) waited up to NODE_DEATH_S
    (30 s) for Ray to report a node dead; where every node the strategy uses answers (its raylet
    accepts a connection), none is lost and the next restart goes on at once."""
    monkeypatch.setattr(recovery, "NODE_DEATH_S", 30.0)
    slept = []
    monkeypatch.setattr(recovery.time, "sleep", slept.append)
    strategy = get_builder("partitioned_ps", min_partition_bytes=1).build(MODEL, CLUSTER)
    trainer = FakeTrainer(strategy, [[]])
    trainer.pool.binding.answers.append("asked:")
    assert trainer._lost_nodes(True) is None and slept == []
    assert trainer.pool.binding.answers[1:] == [sorted({"a", "b"} | set(strategy.ps_nodes()))]
    quiet = FakeTrainer(strategy, [[], ["b"]])   # a node that does not answer: Ray's report is waited for
    assert quiet._lost_nodes(True) == (["b"], True) and slept == [0.5]


def test_a_raylet_accepts_or_refuses_a_connection():
    import socket

    from autosync.runtime.binding import accepts

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        port = listening.getsockname()[1]
        assert accepts("127.0.0.1", port)
    assert not accepts("127.0.0.1", port)   # closed: refused at once
    assert not accepts(None, None) and not accepts("127.0.0.1", "not a port")
