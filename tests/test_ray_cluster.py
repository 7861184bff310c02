"""``--cluster ray``: a running Ray cluster described by Ray itself (fakes of ``ray.nodes()``; the
local Ray instance; the 2-node testbed is in test_calibrate_runtime.py)."""
from __future__ import annotations

import pytest

from autosync.ray_cluster import describe_nodes, gpu_mib, parse_options, probe_gpu_memory
from strategy_space.errors import ConfigError


def _node(address, cpus=4, gpus=0, head=False, alive=True, node_id=None, **labels):
    res = {"CPU": float(cpus), f"node:{address}": 1.0, "memory": 1e9, **labels}
    if gpus:
        res["GPU"] = float(gpus)
    if head:
        res["node:__internal_head__"] = 1.0
    return {"Alive": alive, "NodeManagerAddress": address, "NodeID": node_id or address.replace(".", "") * 4,
            "Resources": res}


def test_gpu_nodes_get_a_worker_per_gpu_and_a_cpu_only_head_hosts_none():
    nodes = [_node("10.0.0.9", cpus=16, gpus=4), _node("10.0.0.1", cpus=0, head=True),
             _node("10.0.0.5", cpus=16, gpus=8), _node("10.0.0.7", alive=False)]
    spec = describe_nodes(nodes)
    assert [(n.name, n.address, n.workers, n.gpus, n.chief) for n in spec.nodes] == [
        ("node0", "10.0.0.1", 0, 0, True),        # the head first, parameter servers only
        ("node1", "10.0.0.5", 8, 8, False),       # then by address; dead nodes left out
        ("node2", "10.0.0.9", 4, 4, False)]
    assert sum(n.workers for n in spec.nodes) == 12


def test_cpu_nodes_get_one_worker_unless_asked_and_the_link_rate_is_an_option():
    nodes = [_node("10.0.0.1", cpus=8, head=True), _node("10.0.0.2", cpus=8)]
    assert [n.workers for n in describe_nodes(nodes).nodes] == [1, 1]
    spec = describe_nodes(nodes, **{"workers": 3, "gbps": 25.0})
    assert [(n.workers, n.bandwidth_gbps) for n in spec.nodes] == [(3, 25.0), (3, 25.0)]


def test_nodes_sharing_an_address_are_told_apart_by_their_own_labels():
    nodes = [_node("10.0.0.1", head=True, node_id="a" * 32, host0=1.0),
             _node("10.0.0.1", node_id="b" * 32, host1=1.0)]
    spec = describe_nodes(nodes)
    assert [n.resource for n in spec.nodes] == ["host0", "host1"]
    unlabelled = [_node("10.0.0.1", head=True, node_id="a" * 32), _node("10.0.0.1", node_id="b" * 32)]
    with pytest.raises(ConfigError, match="shares address 10.0.0.1 .* --resources"):
        describe_nodes(unlabelled)


def test_a_cluster_without_workers_or_nodes_is_refused():
    with pytest.raises(ConfigError, match="no alive node"):
        describe_nodes([_node("10.0.0.1", alive=False)])
    with pytest.raises(ConfigError, match="no node of the Ray cluster has a CPU"):
        describe_nodes([_node("10.0.0.1", cpus=0, head=True)])


@pytest.mark.parametrize("text, message", [
    ("ray?workers=0", "workers must be a whole number from 1"),
    ("ray?workers=two", "workers must be a whole number from 1"),
    ("ray?gbps=-1", "gbps must be a number > 0"),
    ("ray?gbps=nan", "gbps must be a number > 0"),
    ("ray?intra_gbps=0", "intra_gbps must be a number > 0 .* between the workers of one node"),
    ("ray?intra_gbps=fast", "intra_gbps must be a number > 0"),
    ("ray?nodes=3", "unknown option 'nodes'"),
    ("ray?", "no option after"),
    ("ray?gpu_gib=0", "gpu_gib must be a number > 0 .* each GPU in GiB"),
    ("ray?gpu_gib=lots", "gpu_gib must be a number > 0"),
])
def test_bad_options_say_what_is_allowed(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_options(text)
    assert parse_options("ray?workers=2&gbps=25") == {"workers": 2, "gbps": 25.0}
    assert parse_options("ray?gbps=25&intra_gbps=2400") == {"gbps": 25.0, "intra_gbps": 2400.0}
    assert parse_options("ray?gpu_gib=79.5") == {"gpu_gib": 79.5}


def test_the_links_inside_a_gpu_node_are_an_option_and_said_to_be_assumed_without_it():
    nodes = [_node("10.0.0.1", cpus=32, gpus=8, head=True), _node("10.0.0.2", cpus=32, gpus=8)]
    unsaid = describe_nodes(nodes, gbps=25.0)
    assert unsaid.intra_node_bandwidth_gbps is None
    assert "ray?intra_gbps=X" in unsaid.intra_node_assumption()
    said = describe_nodes(nodes, gbps=25.0, intra_gbps=7200.0)
    assert said.intra_node_bandwidth_gbps == said.intra_node_gbps == 7200.0
    assert said.intra_node_assumption() is None


def test_a_gpus_memory_is_measured_else_its_accelerator_types_else_unknown_unless_given():
    """nvidia-smi's figure (the node's smallest GPU) first; else the accelerator type Ray reports, at
    its largest variant, with a warning; else unknown (not checked, and said); ray?gpu_gib wins."""
    nodes = [_node("10.0.0.1", cpus=16, gpus=2, head=True, node_id="a" * 32, **{"accelerator_type:A100": 1.0}),
             _node("10.0.0.2", cpus=16, gpus=1, node_id="b" * 32, **{"accelerator_type:T4": 1.0}),
             _node("10.0.0.3", cpus=16, gpus=1, node_id="c" * 32, **{"accelerator_type:Mystery-9": 1.0}),
             _node("10.0.0.4", cpus=16, node_id="d" * 32)]
    with pytest.warns(UserWarning, match=r"node1 \(10.0.0.2\): nvidia-smi did not answer there, so its GPU memory is "
                                         r"taken from its accelerator type \(T4\) as 16 GiB"):
        spec = describe_nodes(nodes, gpu_mib={"a" * 32: [81920.0, 40960.0]})
    assert [n.gpu_memory_gib for n in spec.nodes] == [40.0, 16.0, None, None]
    assert spec.gpu_memory_assumption().startswith("GPU memory not checked on node2 ")
    given = describe_nodes(nodes, gpu_gib=24.0, gpu_mib={"a" * 32: [81920.0]})
    assert [n.gpu_memory_gib for n in given.nodes] == [24.0, 24.0, 24.0, None] and given.gpu_memory_assumption() is None


@pytest.mark.parametrize("script, expected", [
    ("echo 81559; echo 81559", [81559.0, 81559.0]),
    ("echo '[N/A]'", None),                       # a driver that cannot tell
    ("echo 'NVIDIA-SMI has failed' >&2; exit 9", None),
    ("", None),                                   # no GPU listed
])
def test_nvidia_smis_answer_is_read_or_left_alone(tmp_path, script, expected):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    assert gpu_mib((str(fake), "--query-gpu=memory.total")) == expected
    assert gpu_mib((str(tmp_path / "missing"),)) is None


@pytest.mark.integration
def test_each_gpu_nodes_memory_is_asked_of_the_node_itself(ray_session, tmp_path):
    """A task pinned to the node, taking no resources, runs the query there; a node without GPUs
    is not asked, and a query that fails leaves the node out."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 23034\n")
    fake.chmod(0o755)
    (node,) = [dict(n) for n in ray_session.nodes() if n["Alive"]]
    gpu_node = {**node, "Resources": {**node["Resources"], "GPU": 1.0}}
    assert probe_gpu_memory([gpu_node], command=(str(fake),)) == {node["NodeID"]: [23034.0]}
    assert probe_gpu_memory([node], command=(str(fake),)) == {}
    assert probe_gpu_memory([gpu_node], command=(str(tmp_path / "missing"),)) == {}
    spec = describe_nodes([gpu_node], gpu_mib=probe_gpu_memory([gpu_node], command=(str(fake),)))
    assert spec.nodes[0].gpu_memory_gib == pytest.approx(22.494, abs=1e-3)


@pytest.mark.integration
def test_without_ray_address_the_command_says_how_to_connect(monkeypatch, capsys):
    import ray

    from autosync.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert main(["calibrate", "--cluster", "ray"]) == 2
    err = capsys.readouterr().err
    assert "RAY_ADDRESS is not set" in err and "Traceback" not in err


@pytest.mark.integration
def test_the_connected_ray_instance_is_described_and_bound(ray_session):
    from autosync.runtime.binding import ClusterBinding
    from autosync.sources import load_cluster

    spec = load_cluster("ray?workers=2")
    (node,) = spec.nodes
    cpus = int(ray_session.cluster_resources()["CPU"])
    assert (node.cpus, node.workers, node.chief) == (cpus, 2, True)
    binding = ClusterBinding.bind(spec)   # the description binds back onto the same Ray node
    assert binding.node_ids == {"node0": ray_session.nodes()[0]["NodeID"]} and not binding.started_ray


@pytest.mark.integration
def test_a_gpu_nodes_memory_comes_through_the_cluster_option_as_a_user_gives_it(ray_session, monkeypatch, tmp_path):
    """``--cluster ray`` end to end (``load_cluster``) on the session's node, which Ray is made to report
    with a GPU: nvidia-smi's figure (a fake on the node) where nothing is given, ``ray?gpu_gib=X`` where
    it is (and then nvidia-smi is not asked: the fake would fail)."""
    import ray

    from autosync import ray_cluster
    from autosync.sources import load_cluster

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 40960\necho 81920\n")
    fake.chmod(0o755)
    nodes = [{**n, "Resources": {**n["Resources"], "GPU": 1.0}} for n in ray.nodes()]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(ray_cluster, "NVIDIA_SMI", (str(fake),))
    (node,) = load_cluster("ray").nodes
    assert (node.gpus, node.gpu_memory_gib) == (1, 40.0)
    fake.write_text("#!/bin/sh\nexit 3\n")
    (node,) = load_cluster("ray?gpu_gib=12").nodes
    assert node.gpu_memory_gib == 12.0


def _closed_port() -> int:
    """A loopback port nothing listens at (bound, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_nothing_answers_at_is_told_apart_before_ray_tries_it():
    """Ray's own connect to an address where nothing listens retried for over 5 minutes (measured:
    `autosync run` with RAY_ADDRESS=127.0.0.1:6999 was still waiting at 330 s)."""
    import socket

    from autosync.ray_cluster import _unreachable

    port = _closed_port()
    assert _unreachable(f"127.0.0.1:{port}") == f"nothing listens at 127.0.0.1:{port}"
    assert _unreachable(f"ray://127.0.0.1:{port}") == f"nothing listens at 127.0.0.1:{port}"
    assert _unreachable("nosuchhost.invalid:6379") == "host nosuchhost.invalid is unknown here"
    assert _unreachable("127.0.0.1:70000") == "port 70000 is not a TCP port"
    assert _unreachable("auto") is None   # nothing to try: Ray finds it
    with socket.socket() as listening:   # accepts (the kernel's backlog) and never answers
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        where = f"127.0.0.1:{listening.getsockname()[1]}"
        assert _unreachable(where, timeout_s=0.3) == (f"something listens at {where} but answered nothing in 0.3 s "
                                                      f"(a Ray head's GCS answers at once)")


def _serving(reply: bytes | None):
    """A loopback server that answers each connection's first bytes with ``reply`` (None: closes it)."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        for _ in range(4):
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                if reply is not None:
                    conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return server


@pytest.mark.parametrize("reply, expected", [
    (bytes([0, 0, 6, 4, 0, 0, 0, 0, 0]) + bytes(6), None),   # a gRPC server's SETTINGS frame
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", "an HTTP server answers at {where}, not a Ray head (Ray's dashboard"),
    (b"<!DOCTYPE HTML>\n<html><body>505</body></html>", "an HTTP server answers at {where}, not a Ray head"),
    (b"-ERR unknown command\r\n", "something listens at {where} but it is not a Ray head (it answered b'-ERR unknown"),
    (None, "something listens at {where} but it is not a Ray head (it closed the connection, where a head's GCS "
           "speaks gRPC)"),
])
def test_what_listens_must_speak_grpc_as_a_ray_head_does(monkeypatch, reply, expected):
    """Ray's connect to a port where something else listens (measured: Python's http.server) waited
    on it past 3 minutes, logging GCS time-outs."""
    from autosync.ray_cluster import _unreachable

    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    with _serving(reply) as server:
        where = f"127.0.0.1:{server.getsockname()[1]}"
        why = _unreachable(where, timeout_s=5)
        assert why == expected if expected is None else why.startswith(expected.format(where=where)), why
        monkeypatch.setenv("RAY_USE_TLS", "1")   # a TLS head's first bytes are a handshake: not asked
        assert _unreachable(where, timeout_s=5) is None


@pytest.mark.integration
def test_a_real_ray_head_passes_the_check(ray_session):
    from autosync.ray_cluster import _unreachable

    gcs = ray_session.get_runtime_context().gcs_address
    assert _unreachable(gcs) is None


@pytest.mark.parametrize("mode, token, hinted", [(None, True, True), ("disabled", True, True),
                                                 ("token", True, False), (None, False, False)])
def test_a_failed_connect_names_token_auth_when_a_token_is_at_hand(monkeypatch, tmp_path, mode, token, hinted):
    """`ray start --head` turns token auth on where ~/.ray/auth_token exists; a driver with
    RAY_AUTH_MODE unset then fails with only "Failed to connect" (Ray 2.60, by hand)."""
    from autosync.ray_cluster import _auth_hint

    monkeypatch.setenv("HOME", str(tmp_path))
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    if mode:
        monkeypatch.setenv("RAY_AUTH_MODE", mode)
    if token:
        (tmp_path / ".ray").mkdir()
        (tmp_path / ".ray" / "auth_token").write_text("x" * 64)
    assert ("export RAY_AUTH_MODE=token" in _auth_hint()) is hinted


@pytest.mark.integration
@pytest.mark.parametrize("how", ["cluster ray", "cluster file"])
def test_ray_address_where_nothing_listens_is_a_config_error_in_seconds(monkeypatch, how):
    """Both ways to a running cluster refuse it before Ray's connect: ``--cluster ray`` and a
    cluster YAML or ``local`` with RAY_ADDRESS set (that one raised Ray's ConnectionError, a
    traceback, after minutes)."""
    import time

    import ray

    from autosync.ray_cluster import connect
    from autosync.runtime import binding
    from autosync.sources import local_cluster

    def no_init(*args, **kwargs):
        raise AssertionError("ray.init was called")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_init)
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=rf"could not connect to the Ray cluster at RAY_ADDRESS=127.0.0.1:{port}: "
                                          rf"nothing listens at 127.0.0.1:{port}; fix by giving the head's address"):
        connect() if how == "cluster ray" else binding._start_ray(local_cluster())
    assert time.monotonic() - t0 < 10


def _grpc_head(unauthenticated: bool):
    """A loopback gRPC server that answers the head's cluster-id call as a Ray head with token
    authentication does to a call without a token (UNAUTHENTICATED), or as one without it."""
    from concurrent import futures

    import grpc

    calls = []

    def cluster_id(request, context):
        calls.append(request)
        if unauthenticated:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken: Authentication token is missing")
        return b""

    handler = grpc.method_handlers_generic_handler(
        "ray.rpc.NodeInfoGcsService", {"GetClusterId": grpc.unary_unary_rpc_method_handler(cluster_id)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}", calls


@pytest.mark.parametrize("mode", [None, "disabled", "token"])
@pytest.mark.parametrize("unauthenticated", [True, False])
def test_a_head_that_asks_for_a_token_this_process_does_not_send_is_refused_at_once(monkeypatch, mode,
                                                                                   unauthenticated):
    """Ray's own connect to such a head retried for 20 s and said only "Failed to connect"."""
    from autosync.ray_cluster import _asks_for_token, check_address

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    if mode:
        monkeypatch.setenv("RAY_AUTH_MODE", mode)
    server, address, calls = _grpc_head(unauthenticated)
    try:
        refused = unauthenticated and mode != "token"   # with a token sent, Ray's connect is left to try
        assert _asks_for_token(address) is refused
        assert len(calls) == (0 if mode == "token" else 1)
        if refused:
            with pytest.raises(ConfigError, match=rf"RAY_ADDRESS={address}: its head asks for an authentication "
                                                  rf"token .* fix by exporting RAY_AUTH_MODE=token"):
                check_address(address)
        else:
            check_address(address)
        monkeypatch.setenv("RAY_USE_TLS", "1")   # the probe speaks plain gRPC: not asked over TLS
        asked = len(calls)
        assert _asks_for_token(address) is False and len(calls) == asked
    finally:
        server.stop(None)
    assert _asks_for_token(f"ray://{address}") is False   # Ray Client: not asked


@pytest.mark.integration
def test_a_real_head_with_token_authentication_is_refused_at_once_without_the_token():
    """`ray start --head` with token authentication (as it turns it on where ~/.ray/auth_token
    exists); a command without RAY_AUTH_MODE=token is refused in seconds, saying so (with it, the
    check asks nothing: the fast test above)."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    from autosync.ray_cluster import _unreachable

    home = tempfile.mkdtemp(prefix="rt", dir="/tmp")   # short: Ray's socket paths live under --temp-dir
    port = _closed_port()
    bin_dir = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(HOME=home, RAY_USAGE_STATS_ENABLED="0")
    head = subprocess.Popen([os.path.join(bin_dir, "ray"), "start", "--head", "--block", "--port", str(port),
                             "--num-cpus", "0", "--include-dashboard", "false", "--disable-usage-stats",
                             "--temp-dir", home], env={**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "a" * 64},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while _unreachable(address, 1.0) is not None and head.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert head.poll() is None, "the head did not start"
        t0 = time.monotonic()
        r = subprocess.run([os.path.join(bin_dir, "autosync"), "plan", "--model", "zoo:ncf", "--cluster", "ray"],
                           env={**env, "RAY_ADDRESS": address}, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr[-2000:]
        assert "its head asks for an authentication token" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert time.monotonic() - t0 < 15   # Ray's own connect gave up after 20 s, saying only "Failed to connect"
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(60)
