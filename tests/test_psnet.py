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
    # the big array travels as a frame of its own, not inside the pickle
    assert len(frames) >= 3 and len(frames[1]) < big.nbytes
    tag, (method, (source, step, got)) = psnet.decode(frames)
    assert (tag, method, source, step) == (7, "push", 0, 3)
    assert np.array_equal(got["k"], big) and got["n"] is None
    assert np.array_equal(got[("emb", 0)][0], [3, 1]) and got[("emb", 0)][1].dtype == np.float16


@pytest.fixture
def server():
    """A Server on its own event loop thread: ``push`` stores, ``pull`` waits for a push, ``boom`` fails."""
    loop = asyncio.new_event_loop()
    box: dict = {}
    state = {"pushed": []}

    async def handler(method, args):
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
        assert psnet.gather([link.call("push", np.ones(3)), link.call("pull")])[1].tolist() == [2.0, 2.0, 2.0]
        assert len(state["pushed"]) == 2
    finally:
        link.close()


def test_a_link_pickles_as_its_endpoint_and_reconnects(server):
    import pickle

    srv, _ = server
    link = psnet.Link(srv.endpoint, actor=None)
    link.call("push", np.ones(2)).result()
    copy = pickle.loads(pickle.dumps(link))
    try:
        assert copy.endpoint == srv.endpoint and copy._sock is None
        assert copy.call("pull").result().tolist() == [2.0, 2.0]
    finally:
        link.close()
        copy.close()


def test_an_unknown_transport_is_refused_with_the_choices(monkeypatch):
    from strategy_space.errors import ConfigError

    monkeypatch.setenv("AUTOSYNC_PS_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ConfigError, match="zmq, ray"):
        psnet.transport()
    monkeypatch.delenv("AUTOSYNC_PS_TRANSPORT")
    assert psnet.transport() == psnet.TRANSPORT
