"""The parameter servers' data plane: pushes and pulls over ZeroMQ, Ray as the control plane.

Ray places, starts, supervises and kills the PS actors; the bytes of a PS step ride one ZeroMQ
connection per (worker, PS actor) pair instead: the actor serves a ROUTER socket from its own event
loop, each worker talks to it through a DEALER socket. Measured on the testbed
(``benchmarks/results/ps_transport.json``, 2 nodes at 200mbit): a push and a pull at once run at
0.95 of the link each way over ZeroMQ against 0.47 through Ray's object store (and 0.48 over gloo
point to point), and a request's round trip costs ~0.2 ms against ~1.4 ms for an actor call. This
is the engine ps-lite (BytePS, MXNet's parameter server) moves its keys and values with.

A message is ``[tag, pickle, *buffers]``: the call (method name and arguments) or its reply pickled
with protocol 5, its arrays of ``INBAND_MAX`` bytes or more as frames of their own (received arrays
are read-only views of the frames), smaller ones inside the pickle (a copy of a few kilobytes costs
less than a frame; ``worker_dispatch_2x200mbit.json``). The tag matches a reply to its request, so a
worker may have many calls to one actor in flight (pushes while it pulls) and collect each when it
needs it. A reply is ``(True, result)`` or ``(False, error text)``; the worker raises the error
where it collects the reply, as a Ray call raises in ``ray.get``.

A link is two connections, two lanes: pushes on one, every other call (pulls above all) on the
other. On one connection a pull request of step t+1, sent right after step t's push, would reach
the actor only behind the push's megabytes (TCP delivers in order), so the actor could serve no
chunk of the pull before the whole push was in: the push then the pull, never both directions of
the link at once. On a lane of its own the request arrives at once and waits on the actor, which
sends each chunk as soon as every worker pushed it, while later chunks are still arriving.

A worker waiting for a reply checks every ``LIVENESS_S`` seconds, through Ray, that the actor is
alive: a killed PS surfaces as Ray's ``RayActorError`` naming it (the runtime reports that actor's
death), not as a hang until the trial's deadline.

``AUTOSYNC_PS_TRANSPORT=ray`` sends PS calls through Ray instead (today's measurements' baseline).
Actors holding locally replicated shards keep Ray calls: their pull returns an object reference
that the workers of a node share through its object store.
"""
from __future__ import annotations

import itertools
import os
import pickle
import threading
import time

TRANSPORT = "zmq"
TRANSPORTS = ("zmq", "ray")
LIVENESS_S = 2.0
# a link's connections: pushes on the first, every other call on the second (see the module doc);
# AUTOSYNC_PS_LANES=1 puts every call on one connection (the data plane before lanes, for comparison)
LANES = 2
# arrays smaller than this travel inside the pickle, not as frames of their own
INBAND_MAX = 64 * 1024
# frames below this are copied when sent, larger ones lent to ZeroMQ without a copy: a lent frame
# costs a wake-up of pyzmq's garbage-collector thread (and the GIL) when ZeroMQ is done with it,
# more than copying a few hundred kilobytes
COPY_BELOW = 1 << 20


def lane_count() -> int:
    """Connections per link: ``$AUTOSYNC_PS_LANES`` (1 or 2, read where a link is made) or ``LANES``."""
    raw = os.environ.get("AUTOSYNC_PS_LANES", "").strip()
    if not raw:
        return LANES
    if raw not in ("1", "2"):
        from strategy_space.errors import ConfigError

        raise ConfigError(f"AUTOSYNC_PS_LANES must be 1 (every PS call on one connection) or 2 (pushes on a "
                          f"connection of their own), got {raw!r}; unset it for {LANES}")
    return int(raw)


def transport() -> str:
    """The PS transport in use: ``AUTOSYNC_PS_TRANSPORT`` if set, else ``TRANSPORT``."""
    name = os.environ.get("AUTOSYNC_PS_TRANSPORT", TRANSPORT)
    if name not in TRANSPORTS:
        from strategy_space.errors import ConfigError

        raise ConfigError(f"AUTOSYNC_PS_TRANSPORT={name!r} is not one of {', '.join(TRANSPORTS)}; unset it to use "
                          f"{TRANSPORT}")
    return name


def encode(tag: int, obj) -> list:
    """Frames of one message: the tag, the pickle, the out-of-band buffers (``INBAND_MAX``)."""
    buffers: list = []

    def out_of_band(buffer) -> bool:   # pickle keeps a buffer in-band where this returns True
        if buffer.raw().nbytes < INBAND_MAX:
            return True
        buffers.append(buffer)
        return False

    data = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
    return [tag.to_bytes(8, "little"), data, *(b.raw() for b in buffers)]


def decode(frames: list) -> tuple[int, object]:
    """``(tag, obj)`` of a message's frames (``zmq.Frame`` or bytes)."""
    views = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
    return int.from_bytes(views[0], "little"), pickle.loads(views[1], buffers=views[2:])


def node_address() -> str:
    """The IP address of this process's Ray node (where a PS actor binds its socket)."""
    import ray

    return ray.util.get_node_ip_address()


class Server:
    """A PS actor's end: a ROUTER socket served on the actor's event loop.

    ``handler(method, args)`` is awaited for each request (concurrently: a pull that waits for a
    version does not hold up the pushes that will produce it).
    """

    def __init__(self, handler, address: str):
        import asyncio

        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.copy_threshold = COPY_BELOW
        for opt in (zmq.SNDHWM, zmq.RCVHWM):
            self._sock.setsockopt(opt, 0)   # never drop or stall a reply: the PS step bounds what is in flight
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{address}")
        self.endpoint = f"tcp://{address}:{port}"
        self._handler = handler
        self._tasks: set = set()
        self._loop_task = asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        import asyncio

        while True:
            frames = await self._sock.recv_multipart(copy=False)
            task = asyncio.ensure_future(self._answer(frames[0].bytes, frames[1:]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        """Stop serving and close the socket (the actor's death does the same)."""
        self._loop_task.cancel()
        for task in list(self._tasks):
            task.cancel()
        self._sock.close(0)
        self._ctx.term()

    async def _answer(self, ident: bytes, frames: list) -> None:
        tag = 0
        try:
            tag, (method, args) = decode(frames)
            reply = (True, await self._handler(method, args))
        except Exception as e:  # noqa: BLE001 - the worker raises it where it collects the reply
            reply = (False, str(e) if type(e) is RuntimeError else f"{type(e).__name__}: {e}")
        await self._sock.send_multipart([ident, *encode(tag, reply)], copy=False)


class Link:
    """A worker's end of one PS actor's connection (pickled to the worker by endpoint; the socket
    opens there on first use).

    Args:
        endpoint: the actor's ``Server.endpoint``.
        actor: the actor's Ray handle (to check it is alive while waiting), or None for a server
            outside Ray (nothing to check).
        lanes: connections to the actor: 2 (pushes on one, other calls on the other; see the module
            doc) or 1; None: ``lane_count()``.
    """

    def __init__(self, endpoint: str, actor, lanes: int | None = None):
        self.endpoint = endpoint
        self.actor = actor
        self.lanes = lane_count() if lanes is None else int(lanes)
        self._socks: list = [None] * self.lanes
        self._lock = threading.Lock()
        self._tags = itertools.count(1)
        self._replies: dict[int, tuple] = {}
        self._probe = None
        self._poller = None

    def __getstate__(self):
        return {"endpoint": self.endpoint, "actor": self.actor, "lanes": self.lanes}

    def __setstate__(self, state):
        self.__init__(state["endpoint"], state["actor"], state.get("lanes"))

    def _socket(self, lane: int):
        if self._socks[lane] is None:
            import zmq

            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.copy_threshold = COPY_BELOW
            for opt in (zmq.SNDHWM, zmq.RCVHWM):
                sock.setsockopt(opt, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint)
            self._socks[lane] = sock
            self._poller = None
        return self._socks[lane]

    def call(self, method: str, *args) -> "Pending":
        """Send a request without waiting; collect its reply with ``wait`` (or ``gather``)."""
        with self._lock:
            tag = next(self._tags)
            lane = 1 if method != "push" and self.lanes > 1 else 0
            self._socket(lane).send_multipart(encode(tag, (method, args)), copy=False)
        return Pending(self, tag)

    def done(self, tag: int) -> bool:
        """Whether the reply of ``tag`` is in (reads what has arrived, never waits)."""
        with self._lock:
            self._drain()
            return tag in self._replies

    def wait(self, tag: int):
        """The result of request ``tag`` (raises its error, or the actor's death)."""
        quiet_since = time.monotonic()
        while True:
            with self._lock:
                if tag in self._replies:
                    ok, value = self._replies.pop(tag)
                    if not ok:
                        raise RuntimeError(value)
                    return value
                if self._wait_readable(100):
                    self._drain()
                    quiet_since = time.monotonic()
                    continue
            if self.actor is not None and time.monotonic() - quiet_since > LIVENESS_S:   # (None: no Ray actor)
                self._check_alive()
                quiet_since = time.monotonic()

    def _wait_readable(self, timeout_ms: int) -> bool:
        """Whether a reply arrived on any open lane within ``timeout_ms``."""
        import zmq

        if self._poller is None:
            self._poller = zmq.Poller()
            for sock in self._socks:
                if sock is not None:
                    self._poller.register(sock, zmq.POLLIN)
        return bool(self._poller.poll(timeout_ms))

    def _drain(self) -> None:
        import zmq

        for sock in self._socks:
            while sock is not None:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                tag, reply = decode(frames)
                self._replies[tag] = reply

    def _check_alive(self) -> None:
        """Raise Ray's actor error if the actor died (one ``ready`` probe in flight at a time)."""
        import ray

        if self._probe is None:
            self._probe = self.actor.ready.remote()
            return
        done, _ = ray.wait([self._probe], timeout=0)
        if done:
            probe, self._probe = self._probe, None
            ray.get(probe)   # raises RayActorError when the actor is dead

    def close(self) -> None:
        with self._lock:
            for sock in self._socks:
                if sock is not None:
                    sock.close(0)
            self._socks = [None] * self.lanes
            self._poller = None
            self._replies.clear()


class Pending:
    """One request in flight on a ``Link``."""

    __slots__ = ("link", "tag")

    def __init__(self, link: Link, tag: int):
        self.link, self.tag = link, tag

    def done(self) -> bool:
        return self.link.done(self.tag)

    def result(self):
        return self.link.wait(self.tag)


def gather(items: list) -> list:
    """Results of a list of ``Pending`` requests and Ray object refs, in order."""
    refs = [x for x in items if not isinstance(x, Pending)]
    got = iter(_ray().get(refs) if refs else [])
    return [x.result() if isinstance(x, Pending) else next(got) for x in items]


def finished(items: list) -> list:
    """Those of ``items`` (``Pending`` or Ray refs) already complete, never waiting."""
    refs = [x for x in items if not isinstance(x, Pending)]
    done = set(_ray().wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
    return [x for x in items if (x.done() if isinstance(x, Pending) else x in done)]


def _ray():
    import ray

    return ray
