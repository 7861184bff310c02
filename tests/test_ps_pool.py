"""The PS pool's bookkeeping, with fake actors (Ray's calls replaced: no cluster): a clean
session's actors come back idle and are reset onto the next session's shards; an actor whose
``release`` fails or does not answer is killed, never lent again; a Keras session prefers an actor
that imported Keras; ``kill``/``kill_all`` leave nothing lent or idle."""
from __future__ import annotations

import itertools
from types import SimpleNamespace as NS

import pytest

pytestmark = pytest.mark.integration   # imports ray (its calls are replaced)

_ids = itertools.count()


class _Ref:
    def __init__(self, actor, method, args):
        self.actor, self.method, self.args = actor, method, args


class _Method:
    def __init__(self, actor, name):
        self.actor, self.name = actor, name

    def remote(self, *args):
        self.actor.calls.append(self.name)
        return _Ref(self.actor, self.name, args)


class _Actor:
    def __init__(self, node, args):
        self.node, self.args, self.calls = node, args, []
        self.release_fails = self.release_hangs = False
        self._actor_id = NS(hex=lambda n=next(_ids): f"actor{n}")

    def __getattr__(self, name):
        return _Method(self, name)


class _Pool:
    """A PSPool whose new actors are fakes."""

    def __new__(cls):
        from autosync.runtime.ps_pool import PSPool

        class Pool(PSPool):
            def _new(self, node, args=()):
                actor = _Actor(node, args)
                self.made.append(actor)
                return actor

        pool = Pool(binding=None, actor_class=None)
        pool.made = []
        return pool


@pytest.fixture
def killed(monkeypatch):
    import ray

    out = []

    def wait(refs, num_returns, timeout):
        done = [r for r in refs if not r.actor.release_hangs]
        return done, [r for r in refs if r not in done]

    def get(ref):
        if ref.method == "release" and ref.actor.release_fails:
            raise RuntimeError("unapplied pushes")
        return None

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: out.append(actor))
    return out


def test_a_clean_sessions_actors_are_reset_onto_the_next_sessions_shards(killed):
    pool = _Pool()
    a, ref = pool.take("n0", ("shards-1",), keras=False)
    assert pool.made == [a] and a.args == ("shards-1",) and ref.method == "ready" and len(pool) == 1
    pool.give_back([a])
    assert pool.idle["n0"] == [a] and not pool.lent and a.calls == ["ready", "release"] and not killed
    b, ref = pool.take("n0", ("shards-2",), keras=False)
    assert b is a and ref.method == "reset" and ref.args == ("shards-2",) and pool.made == [a]
    # another node has no idle actor: a new one
    c, _ = pool.take("n1", ("shards-3",), keras=False)
    assert c is not a and pool.made == [a, c]


@pytest.mark.parametrize("how", ["release_fails", "release_hangs"])
def test_an_actor_that_does_not_release_cleanly_is_killed_never_lent_again(killed, how):
    pool = _Pool()
    good, _ = pool.take("n0", (), keras=False)
    bad, _ = pool.take("n0", (), keras=False)
    setattr(bad, how, True)
    pool.give_back([good, bad])
    assert killed == [bad] and pool.idle["n0"] == [good] and not pool.lent
    again = [pool.take("n0", (), keras=False)[0] for _ in range(2)]
    assert again[0] is good and again[1] is not bad and len(pool.made) == 3


def test_a_keras_session_takes_an_actor_that_imported_keras_first(killed):
    pool = _Pool()
    plain, _ = pool.take("n0", (), keras=False)
    loaded, _ = pool.take("n0", (), keras=True)
    pool.give_back([plain, loaded])
    assert pool.take("n0", (), keras=True)[0] is loaded
    assert pool.take("n0", (), keras=False)[0] is plain


def test_kill_and_kill_all_leave_nothing(killed):
    pool = _Pool()
    a, _ = pool.take("n0", (), keras=True)
    b, _ = pool.take("n0", (), keras=False)
    pool.kill([a])
    assert killed == [a] and list(pool.lent) == [b._actor_id.hex()] and a._actor_id.hex() not in pool.with_keras
    pool.give_back([b])
    c, _ = pool.take("n1", (), keras=False)
    pool.kill_all()
    assert set(killed) == {a, b, c} and len(pool) == 0 and not pool.with_keras


def test_a_pooled_shards_drop_clears_keras_and_freezes_what_is_left_once(monkeypatch):
    """``_drop`` clears Keras' session state each time; the first time it also freezes the objects
    then alive (TensorFlow's and Keras' own), so later sessions' collections do not scan them."""
    import gc
    import sys

    from autosync.runtime import ps_pool

    cleared, frozen = [], []
    monkeypatch.setitem(sys.modules, "keras", NS(utils=NS(clear_session=lambda: cleared.append(1))))
    monkeypatch.setattr(ps_pool, "_FROZEN", False)
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(1))
    shard = ps_pool.PooledShard()
    shard._server = None
    for _ in range(3):
        shard._drop()
    assert (len(cleared), len(frozen)) == (3, 1) and shard.params == {} and shard.optimizer is None
    monkeypatch.delitem(sys.modules, "keras")
    monkeypatch.setattr(ps_pool, "_FROZEN", False)
    shard._drop()   # a numpy-path actor imports nothing and freezes nothing
    assert (len(cleared), len(frozen)) == (3, 1)


def _model_def(optimizer_fn):
    return NS(optimizer_fn=optimizer_fn)


def _sgd_cosine():
    import keras

    return keras.optimizers.SGD(keras.optimizers.schedules.CosineDecay(0.1, decay_steps=100))


def _sgd_constant():
    import keras

    return keras.optimizers.SGD(0.1)


def _broken():
    raise ValueError("no optimizer today")


@pytest.mark.parametrize("optimizer_fn, keras_path", [(_sgd_cosine, True), (_sgd_constant, False), (_broken, False)])
def test_expect_starts_an_actor_per_node_beside_the_workers_load_and_imports_keras_only_for_the_keras_path(
        killed, optimizer_fn, keras_path):
    import keras  # noqa: F401 - the driver has imported Keras (the commands' optimizer check does)

    pool = _Pool()
    assert pool.expect(_model_def(optimizer_fn), ["n1", "n0", "n1"]) is keras_path
    assert sorted(pool.idle) == ["n0", "n1"] and [a.node for a in pool.made] == ["n0", "n1"]
    assert all(a.calls == (["preload"] if keras_path else []) for a in pool.made)
    # the first session takes the actor started then (reset onto its shards), not a new one
    first = pool.made[0]
    actor, ref = pool.take("n0", ("shards",), keras=keras_path)
    assert actor is first and ref.method == "reset" and len(pool.made) == 2
    # and the session's own prepare finds it done: no second import
    pool.give_back([actor])
    pool.prepare(["n0"], keras_path)
    assert first.calls.count("preload") == (1 if keras_path else 0) and len(pool.made) == 2


def test_expect_never_imports_keras_in_the_driver(killed, monkeypatch):
    import sys

    called = []
    monkeypatch.delitem(sys.modules, "keras", raising=False)
    pool = _Pool()
    assert pool.expect(_model_def(lambda: called.append(1)), ["n0"]) is False
    assert not called and "keras" not in sys.modules and [a.calls for a in pool.made] == [[]]
    assert pool.expect(_model_def(_sgd_cosine), []) is False and len(pool.made) == 1


def test_expect_leaves_a_node_the_cluster_lacks_to_the_strategys_validation(killed):
    pool = _Pool()
    pool.binding = NS(keys={"n0": "node:n0"})
    assert pool.expect(_model_def(_sgd_constant), ["n0", "nowhere"]) is False
    assert [a.node for a in pool.made] == ["n0"] and "nowhere" not in pool.idle


@pytest.mark.parametrize("awaited, expected", [
    ("parameter server ps@n0", "parameter server ps@n0 died (the actor process exited or was killed)"),
    ("worker n0:0", "parameter server ps@n0 died (the actor process exited or was killed; worker n0:0 lost it)")])
def test_wait_all_names_the_actor_that_died_and_who_lost_it(monkeypatch, awaited, expected):
    """A PS actor killed before its session used it fails the session's wait on that very actor:
    its own death, not one it lost (the pool now starts PS actors while the workers load)."""
    import ray

    from autosync.runtime.engine import TrialFailed, wait_all

    dead = "ab" * 14
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (refs[:1], refs[1:]))

    def get(ref):
        raise RuntimeError(f"The actor is dead because its worker process has died. actor_id: {dead}")

    monkeypatch.setattr(ray, "get", get)
    what, who = awaited.rsplit(" ", 1)
    with pytest.raises(TrialFailed) as e:
        wait_all(["ref"], None, what, [who], {dead: "parameter server ps@n0", "cd" * 14: "worker n0:0"})
    assert str(e.value) == expected


@pytest.mark.parametrize("error", ["died", "oom"])
def test_wait_all_says_when_ray_killed_an_actor_for_memory(monkeypatch, error):
    """Ray's memory monitor's kill: its page of statistics becomes a sentence with the node's use,
    whether the wait saw the actor die or the out-of-memory error itself."""
    import ray

    from autosync.runtime.engine import TrialFailed, wait_all
    from tests.test_exception_text import KILLED_FOR_MEMORY

    dead = "ab" * 14
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (refs[:1], refs[1:]))

    def get(ref):
        if error == "oom":
            raise ray.exceptions.OutOfMemoryError(KILLED_FOR_MEMORY)
        raise RuntimeError(f"The actor died unexpectedly. actor_id: {dead}\n{KILLED_FOR_MEMORY}")

    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(TrialFailed) as e:
        wait_all(["ref"], None, "worker", ["n0:0"], {dead: "parameter server ps@n0"})
    said = {"died": "parameter server ps@n0 died (Ray killed it for memory: the node at 10.0.0.7 had 22.82GB used / "
                    "23.54GB limit, 21.75GB of it in the process killed. What",
            "oom": "worker n0:0 failed: OutOfMemoryError: Ray killed it for memory: the node at 10.0.0.7 had "}[error]
    assert str(e.value).startswith(said) and "\n" not in str(e.value)
    assert str(e.value).endswith("or use a node with more memory" + ("; worker n0:0 lost it)" if error == "died" else ""))


def test_a_wait_on_actors_of_a_lost_node_fails_naming_it_instead_of_waiting_out_the_deadline(monkeypatch):
    """An actor pinned to a node that left the cluster is never placed: its refs would wait until
    the trial's deadline (300 s by default). Given ``alive``, a wait asks it whenever
    ``ALIVE_CHECK_S`` pass without progress and fails with what it says; while the cluster is
    whole it goes on waiting (and without ``alive`` it waits as before, to the deadline)."""
    import time

    import ray

    from autosync.runtime.waiting import ALIVE_CHECK_S, TrialFailed, TrialTimeout, wait_all

    asked = []
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (asked.append(timeout), ([], refs))[1])
    said = iter(["", "", "node(s) n1 left the Ray cluster (Ray reports them dead), ..."])
    with pytest.raises(TrialFailed) as e:
        wait_all(["ref"], time.monotonic() + 300, "worker", ["n1:0"], alive=lambda: next(said))
    assert str(e.value).startswith("node(s) n1 left the Ray cluster") and not isinstance(e.value, TrialTimeout)
    assert len(asked) == 3 and all(0 < t <= ALIVE_CHECK_S for t in asked)
    asked.clear()
    with pytest.raises(TrialFailed, match="node\\(s\\) n1 left"):   # no deadline: asked all the same
        wait_all(["ref"], None, "worker", ["n1:0"], alive=lambda: "node(s) n1 left")
    assert asked == [ALIVE_CHECK_S]
    asked.clear()
    with pytest.raises(TrialTimeout):
        wait_all(["ref"], time.monotonic() + 0.05, "worker", ["n1:0"])
    assert asked and all(t <= 0.05 for t in asked)


def test_a_wait_past_its_deadline_names_what_did_not_finish(monkeypatch):
    """"worker: time limit reached with 1 of 2 unfinished" said how many, not which: a worker whose
    process hangs (a stopped process, a driver call that never returns) is named."""
    import time

    import ray

    from autosync.runtime.waiting import TrialTimeout, wait_all

    refs = [f"ref{i}" for i in range(10)]
    monkeypatch.setattr(ray, "get", lambda ref: ref)
    done = iter([["ref1"]])
    monkeypatch.setattr(ray, "wait", lambda pending, num_returns, timeout: (
        (lambda d: (d, [r for r in pending if r not in d]))(next(done, []))))
    with pytest.raises(TrialTimeout) as e:
        wait_all(refs[:2], time.monotonic() + 0.05, "worker", ["n0:0", "n0:1"])
    assert str(e.value) == "worker: time limit reached with 1 of 2 unfinished (worker n0:0)"
    with pytest.raises(TrialTimeout) as e:
        wait_all(refs, time.monotonic() + 0.05, "worker", [f"n{i}:0" for i in range(10)])
    assert str(e.value) == ("worker: time limit reached with 10 of 10 unfinished (worker n0:0, worker n1:0, "
                            "worker n2:0, worker n3:0, worker n4:0, worker n5:0, worker n6:0, worker n7:0, ...)")
    with pytest.raises(TrialTimeout) as e:   # no names: how many alone
        wait_all(refs[:2], time.monotonic() + 0.05, "worker")
    assert str(e.value) == "worker: time limit reached with 2 of 2 unfinished"
