"""The PS data plane's message framing and request/reply matching (ZeroMQ on loopback, no Ray)."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from autosync.runtime import psnet


def test_encode_decode_keeps_arrays_and_structure_without_copying_payload():
    big = np.arange(100_000, dtype=np.float32)
    msg = {"k": big, ("emb", 0): (np.array([3, 1], np.int32), np.ones((2, 4), np.float16)), "n": None}
    frames = psnet.encode(7, ("push", (0, 3, msg)))
    # the big array travels as a frame of its own, not inside the pickle; the small ones inside it
    assert len(frames) == 3 and len(frames[1]) < big.nbytes and memoryview(frames[2]).nbytes == big.nbytes
    tag, (method, (source, step, got)) = psnet.decode(frames)
    assert (tag, method, source, step) == (7, "push", 0, 3)
    assert np.array_equal(got["k"], big) and got["n"] is None
    assert np.array_equal(got[("emb", 0)][0], [3, 1]) and got[("emb", 0)][1].dtype == np.float16


def test_arrays_below_the_in_band_limit_travel_inside_the_pickle():
    just_below = np.zeros(psnet.INBAND_MAX // 4 - 1, np.float32)
    at_limit = np.ones(psnet.INBAND_MAX // 4, np.float32)
    frames = psnet.encode(1, [just_below, at_limit, np.arange(3.0)])
    assert len(frames) == 3 and memoryview(frames[2]).nbytes == at_limit.nbytes
    got = psnet.decode(frames)[1]
    assert [a.tolist() for a in got] == [just_below.tolist(), at_limit.tolist(), [0.0, 1.0, 2.0]]


@pytest.fixture
def server():
    """A Server on its own event loop thread: ``push`` stores, ``pull`` waits for a push, ``boom`` fails."""
    loop = asyncio.new_event_loop()
    box: dict = {}
    state = {"pushed": []}

    async def handler(method, args):
        state.setdefault("order", []).append(method)
        if method == "push":
            state["pushed"].append(args)
            return None
        if method == "pull":
            while not state["pushed"]:   # a pull waits without holding up the push it waits for
                await asyncio.sleep(0.01)
            return state["pushed"][-1][0] * 2
        raise ValueError(f"no method {method}")

    async def start():
        box["server"] = psnet.Server(handler, "127.0.0.1")

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield box["server"], state

    async def stop():
        box["server"].close()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_replies_match_their_requests_in_any_order_and_errors_reach_the_caller(server):
    srv, state = server
    link = psnet.Link(srv.endpoint, actor=None)
    try:
        pull = link.call("pull")                       # waits on the server for the push below
        push = link.call("push", np.arange(5.0))
        bad = link.call("boom", 1)
        assert push.result() is None
        assert np.array_equal(pull.result(), np.arange(5.0) * 2)
        with pytest.raises(RuntimeError, match="ValueError: no method boom"):
            bad.result()
        # a pull may overtake a push sent before it (another lane): read after the pushes' replies
        assert psnet.gather([link.call("push", np.ones(3)), link.call("push", np.full(3, 2.0))]) == [None, None]
        assert link.call("pull").result().tolist() == [4.0, 4.0, 4.0]
        assert len(state["pushed"]) == 3
    finally:
        link.close()


def test_both_ends_copy_frames_below_a_mebibyte_and_lend_larger_ones(server):
    """A frame sent without a copy costs pyzmq's garbage-collector thread a wake-up when ZeroMQ
    frees it: both ends copy frames under ``COPY_BELOW`` (pyzmq's own default is 64 KiB)."""
    srv, _ = server
    link = psnet.Link(srv.endpoint, actor=None)
    try:
        assert link.call("push", np.zeros(300_000, np.float32)).result() is None   # a frame of 1.2 MB
        assert srv._sock.copy_threshold == psnet.COPY_BELOW
        assert all(s is None or s.copy_threshold == psnet.COPY_BELOW for s in link._socks)
        assert any(s is not None for s in link._socks)
    finally:
        link.close()


def test_a_link_pickles_as_its_endpoint_and_reconnects(server):
    import pickle

    srv, _ = server
    link = psnet.Link(srv.endpoint, actor=None)
    link.call("push", np.ones(2)).result()
    copy = pickle.loads(pickle.dumps(link))
    try:
        assert copy.endpoint == srv.endpoint and copy.lanes == link.lanes and copy._socks == [None, None]
        assert copy.call("pull").result().tolist() == [2.0, 2.0]
    finally:
        link.close()
        copy.close()


def test_pushes_and_other_calls_travel_on_connections_of_their_own():
    """Each lane is a connection of its own: a ROUTER sees a push and a pull of one link from two
    peers, whatever the order they were sent in."""
    import zmq

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    link = psnet.Link(f"tcp://127.0.0.1:{port}", actor=None)
    try:
        for method in ("push", "pull", "push", "stats"):
            link.call(method, 1)
        seen = {}
        for _ in range(4):
            assert router.poll(5000), "a request never arrived"
            ident, *frames = router.recv_multipart()
            seen.setdefault(psnet.decode(frames)[1][0], set()).add(ident)
        assert len(seen["push"]) == 1 and seen["pull"] == seen["stats"] and seen["push"] != seen["pull"]
    finally:
        link.close()
        router.close(0)


@pytest.mark.parametrize("lanes, first", [(2, "pull"), (1, "push")])
def test_a_pull_sent_after_a_big_push_reaches_the_actor_first(server, lanes, first):
    """The reason for the lanes: on one connection (``AUTOSYNC_PS_LANES=1``) the pull request waits
    behind the push's bytes (TCP keeps order), so a PS cannot serve a pull while a push is still
    arriving; on a lane of its own it arrives first."""
    srv, state = server
    order = state.setdefault("order", [])
    link = psnet.Link(srv.endpoint, actor=None, lanes=lanes)
    try:
        link.call("push", np.arange(4.0)).result()             # every connection up before timing
        link.call("pull").result()
        order.clear()
        state["pushed"].clear()
        big = np.ones(32 * 2**20, np.float32)                  # 128 MiB: long on any loopback
        push = link.call("push", big)
        pull = link.call("pull")
        pull.result(), push.result()
        assert order[:2] == [first, "push" if first == "pull" else "pull"], order
    finally:
        link.close()


def test_the_lane_count_comes_from_the_environment_and_bad_values_are_refused(monkeypatch):
    from strategy_space.errors import ConfigError

    monkeypatch.setenv("AUTOSYNC_PS_LANES", "1")
    assert psnet.Link("tcp://127.0.0.1:1", actor=None).lanes == 1
    monkeypatch.setenv("AUTOSYNC_PS_LANES", "3")
    with pytest.raises(ConfigError, match="AUTOSYNC_PS_LANES must be 1 .* got '3'"):
        psnet.lane_count()
    monkeypatch.delenv("AUTOSYNC_PS_LANES")
    assert psnet.lane_count() == psnet.LANES == 2


def test_an_unknown_transport_is_refused_with_the_choices(monkeypatch):
    from strategy_space.errors import ConfigError

    monkeypatch.setenv("AUTOSYNC_PS_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ConfigError, match="zmq, ray"):
        psnet.transport()
    monkeypatch.delenv("AUTOSYNC_PS_TRANSPORT")
    assert psnet.transport() == psnet.TRANSPORT
