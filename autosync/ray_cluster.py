"""``--cluster ray``: the Ray cluster this process connects to, described by Ray itself.

A user on an existing Ray cluster writes no cluster YAML:

    RAY_ADDRESS=head:6379 autosync tune --model zoo:ncf --cluster ray
    RAY_ADDRESS=head:6379 autosync calibrate --cluster ray --out my_cluster.yaml

Every alive Ray node becomes a node of the spec: its address, CPUs and GPUs as Ray reports them,
one worker per GPU (one per node without GPUs; ``ray?workers=N`` sets N per node), the head node
as chief. A node with no CPUs (a head started with ``--num-cpus=0``) hosts no workers but may
host parameter servers. Ray does not know a NIC's speed: links are assumed at 10 Gbit/s unless
``ray?gbps=X`` says otherwise; ``autosync calibrate --cluster ray`` measures what they really do.
Nor does it know the links between a node's GPUs: ``ray?intra_gbps=X`` gives them (the cluster's
``intra_node_bandwidth_gbps``; without it the cost model takes its default and says so). Nor a
GPU's memory: a task that takes no resources runs ``nvidia-smi`` on each GPU node (the smallest of
its GPUs counts); where it does not answer, the accelerator type Ray reports is looked up
(``ACCELERATOR_GIB``, the type's largest variant, said in a warning); ``ray?gpu_gib=X`` gives it for
every node instead. A node whose GPU memory stays unknown is not checked, and the predictions say so.
"""
from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import warnings
from urllib.parse import parse_qsl

from autosync import signals
from strategy_space import ClusterSpec, NodeSpec
from strategy_space.cluster_spec import MAX_BANDWIDTH_GBPS, MAX_MEMORY_GIB, MAX_WORKERS
from strategy_space.errors import ConfigError

RAY_FORMS = "ray, ray?workers=N, ray?gbps=X, ray?intra_gbps=X, ray?gpu_gib=X (several: ray?workers=N&gbps=X)"
DEFAULT_GBPS = 10.0
CONNECT_PROBE_S = 5.0   # a head that does not accept a TCP connection in this long is not there
GPU_PROBE_S = 30.0   # how long the GPU nodes' nvidia-smi may take, together (a worker process starts first)
NVIDIA_SMI = ("nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits")
# GiB of one GPU of each accelerator type Ray reports (``accelerator_type:X``), where nvidia-smi does
# not answer; a type sold with several memory sizes takes the largest (V100 16 or 32 GB, A100 40 or
# 80, H100 80 or 94, H20 96 or 141), so that a strategy is never refused for memory the GPU may have
ACCELERATOR_GIB = {
    "K80": 12, "P4": 8, "P100": 16, "V100": 32, "T4": 16, "A10G": 24, "L4": 24, "L40S": 48,
    "A100": 80, "A100-40G": 40, "A100-80G": 80, "H100": 94, "H200": 141, "H20": 141, "B200": 192, "B300": 288,
    "GB200": 192, "GB300": 288, "RTX-PRO-6000": 96, "AMD-Instinct-MI100": 32, "AMD-Instinct-MI210": 64,
    "AMD-Instinct-MI250X-MI250": 128, "AMD-Instinct-MI300A": 128, "Intel-GPU-Max-1100": 48,
    "Intel-GPU-Max-1550": 128,
}
HEAD_RESOURCE = "node:__internal_head__"
# an HTTP/2 client's connection preface and an empty SETTINGS frame; a gRPC server answers with its own
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4   # the frame type in an HTTP/2 frame header's fourth byte
# resources every Ray node may have; anything else is a user's label
_STANDARD = ("node:", "CPU", "GPU", "memory", "object_store_memory", "accelerator_type")


def is_ray_cluster(text: str) -> bool:
    """``ray`` or ``ray?...``."""
    return text == "ray" or text.startswith("ray?")


def parse_options(text: str) -> dict:
    """``ray?workers=2&gbps=25&intra_gbps=2400&gpu_gib=80`` -> ``{"workers": 2, "gbps": 25.0,
    "intra_gbps": 2400.0, "gpu_gib": 80.0}``.

    Raises:
        ConfigError: an unknown option or a value out of range.
    """
    _, _, query = text.partition("?")
    options: dict = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if key == "workers":
            if not (value.isdigit() and 1 <= int(value) <= MAX_WORKERS):
                raise ConfigError(f"--cluster {text}: workers must be a whole number from 1 to {MAX_WORKERS} "
                                  f"(workers per node), got {value!r}")
            options["workers"] = int(value)
        elif key in ("gbps", "intra_gbps"):
            try:
                gbps = float(value)
            except ValueError:
                gbps = float("nan")
            if not 0 < gbps <= MAX_BANDWIDTH_GBPS:
                what = "each node's link" if key == "gbps" else "the links between the workers of one node"
                raise ConfigError(f"--cluster {text}: {key} must be a number > 0 and at most {MAX_BANDWIDTH_GBPS:g} "
                                  f"({what} in Gbit/s), got {value!r}")
            options[key] = gbps
        elif key == "gpu_gib":
            try:
                gib = float(value)
            except ValueError:
                gib = float("nan")
            if not 0 < gib <= MAX_MEMORY_GIB:
                raise ConfigError(f"--cluster {text}: gpu_gib must be a number > 0 (the memory of each GPU in GiB, "
                                  f"e.g. 80 for an H100), got {value!r}")
            options[key] = gib
        else:
            raise ConfigError(f"--cluster {text}: unknown option {key!r}; give {RAY_FORMS}")
    if "?" in text and not options:
        raise ConfigError(f"--cluster {text}: no option after '?'; give {RAY_FORMS}")
    return options


def describe_nodes(ray_nodes: list[dict], *, workers: int | None = None, gbps: float = DEFAULT_GBPS,
                   intra_gbps: float | None = None, name: str = "ray", gpu_gib: float | None = None,
                   gpu_mib: dict | None = None) -> ClusterSpec:
    """A ClusterSpec of ``ray.nodes()`` entries (only the alive ones count); ``intra_gbps``: its
    ``intra_node_bandwidth_gbps`` (None: not known).

    A GPU node's ``gpu_memory_gib`` is ``gpu_gib`` where given, else the smallest of the MiB that
    ``gpu_mib`` (NodeID -> MiB of each GPU, ``probe_gpu_memory``) lists for it, else its
    accelerator type's (``ACCELERATOR_GIB``, with a warning), else unknown.

    Nodes are ``node0`` (the head), then ``node1``, ... by address. A node is found again by its
    address; where several Ray nodes share an address (several on one machine), by a custom
    resource label only it has.

    Raises:
        ConfigError: no alive node, no node with a CPU, or nodes that cannot be told apart.
    """
    alive = [n for n in ray_nodes if n.get("Alive")]
    if not alive:
        raise ConfigError("the Ray cluster has no alive node; start one (ray start --head) and try again")
    alive.sort(key=lambda n: (HEAD_RESOURCE not in n.get("Resources", {}), n.get("NodeManagerAddress", ""),
                              n.get("NodeID", "")))
    by_address: dict[str, int] = {}
    for n in alive:
        by_address[n["NodeManagerAddress"]] = by_address.get(n["NodeManagerAddress"], 0) + 1
    label_count: dict[str, int] = {}
    for n in alive:
        for k in _labels(n):
            label_count[k] = label_count.get(k, 0) + 1
    nodes, problems = [], []
    for i, n in enumerate(alive):
        res = n.get("Resources", {})
        address = n["NodeManagerAddress"]
        cpus, gpus = int(res.get("CPU", 0)), int(res.get("GPU", 0))
        resource = None
        if by_address[address] > 1:
            own = sorted(k for k in _labels(n) if label_count[k] == 1)
            if not own:
                problems.append(f"Ray node {n.get('NodeID', '?')[:12]} shares address {address} with another node and "
                                f"has no custom resource of its own to pin work to it; start each such node with "
                                f"--resources='{{\"hostN\": 1}}' (a distinct label each), or write a cluster YAML")
                continue
            resource = own[0]
        if cpus < 1:
            n_workers = 0   # e.g. a head started with --num-cpus=0: parameter servers only
        elif workers is not None:
            n_workers = workers   # more workers than CPUs share them (the binding gives each cpus / workers)
        else:
            n_workers = gpus or 1
        # Ray splits a node's memory at start into its tasks' and actors' share and the object store's
        memory = float(res.get("memory", 0)) + float(res.get("object_store_memory", 0))
        nodes.append(NodeSpec(name=f"node{i}", address=address, cpus=max(1, cpus), gpus=gpus, workers=n_workers,
                              chief=(i == 0), bandwidth_gbps=float(gbps), resource=resource,
                              memory_gib=memory / 2**30 if memory > 0 else None,
                              gpu_memory_gib=_gpu_gib(n, f"node{i}", gpu_gib, gpu_mib or {}) if gpus else None))
    if problems:
        raise ConfigError(problems)
    if not any(n.workers for n in nodes):
        raise ConfigError("no node of the Ray cluster has a CPU for a worker; add a node with CPUs "
                          "(ray start --address=<head> --num-cpus=N)")
    return ClusterSpec(name=name, nodes=tuple(nodes), intra_node_bandwidth_gbps=intra_gbps)


def _gpu_gib(node: dict, name: str, given: float | None, measured: dict) -> float | None:
    """The memory of each GPU of Ray node ``node`` in GiB (see ``describe_nodes``); None: unknown."""
    if given is not None:
        return given
    mib = measured.get(node.get("NodeID"))
    if mib:
        return min(mib) / 1024
    kinds = [k.partition(":")[2] for k in node.get("Resources", {}) if k.startswith("accelerator_type:")]
    known = [ACCELERATOR_GIB[k] for k in kinds if k in ACCELERATOR_GIB]
    if not known:
        return None
    warnings.warn(f"--cluster ray: {name} ({node.get('NodeManagerAddress')}): nvidia-smi did not answer there, so its "
                  f"GPU memory is taken from its accelerator type ({', '.join(kinds)}) as {min(known):g} GiB, the "
                  f"largest that type comes with; give it with ray?gpu_gib=X where the GPUs have less", stacklevel=2)
    return float(min(known))


def probe_gpu_memory(ray_nodes: list[dict], timeout_s: float = GPU_PROBE_S, command=NVIDIA_SMI) -> dict:
    """NodeID -> MiB of each GPU ``command`` (nvidia-smi) lists, for each alive node Ray gives GPUs
    to, by a task pinned there that takes no resources (it waits for no busy GPU or CPU); a node
    where it is missing, fails or does not answer within ``timeout_s`` (all nodes together) is
    left out."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ids = [n["NodeID"] for n in ray_nodes if n.get("Alive") and float(n.get("Resources", {}).get("GPU", 0)) > 0]
    if not ids:
        return {}
    task = ray.remote(num_cpus=0, max_retries=0)(gpu_mib)
    refs = {task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(i, soft=False)).remote(command): i
            for i in ids}
    done, late = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    for ref in late:
        ray.cancel(ref, force=True)
    out = {}
    for ref in done:
        try:
            mib = ray.get(ref)
        except Exception:  # noqa: BLE001 - a node that cannot run it (AutoSync missing there, ...) is left out
            continue
        if mib:
            out[refs[ref]] = mib
    return out


def gpu_mib(command=NVIDIA_SMI) -> list[float] | None:
    """MiB of each GPU that ``command`` (nvidia-smi's memory query) lists on this machine; None
    where it is missing, fails, or prints anything but numbers ("[N/A]")."""
    try:
        out = subprocess.run(list(command), capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    try:
        mib = [float(line) for line in out.stdout.split()]
    except ValueError:
        return None
    return mib if mib and all(0 < m < math.inf for m in mib) else None


def _labels(node: dict) -> list[str]:
    return [k for k in node.get("Resources", {}) if not k.startswith(_STANDARD)]


def connect() -> None:
    """Connect this process to the Ray cluster at ``$RAY_ADDRESS`` (once).

    Raises:
        ConfigError: RAY_ADDRESS unset, or nothing answers there.
    """
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if not address:
        raise ConfigError("--cluster ray describes the Ray cluster this process connects to, but RAY_ADDRESS is "
                          "not set; fix by setting RAY_ADDRESS=<head address>:6379 (what `ray start --head` "
                          "printed), or use --cluster local")
    check_address(address)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ConfigError(f"could not connect to the Ray cluster at RAY_ADDRESS={address}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}; fix by "
                          f"checking that `ray status --address={address}` answers{_auth_hint()}") from None
    signals.install()   # ray.init replaced the command line's SIGTERM handler (autosync.signals)


def check_address(address: str) -> None:
    """Refuse a ``RAY_ADDRESS`` that is not an address, or where nothing that could be a Ray head
    answers: Ray's own connect retries for minutes before it gives up on such an address.

    Raises:
        ConfigError: saying what answers there, if anything, and what to give instead.
    """
    if not re.fullmatch(r"(ray://)?[A-Za-z0-9_.\-\[\]:]+|auto", address):
        raise ConfigError(f"RAY_ADDRESS={address!r} is not an address; give host:port, e.g. 10.0.0.1:6379")
    why = _unreachable(address)
    if why:
        raise ConfigError(f"could not connect to the Ray cluster at RAY_ADDRESS={address}: {why}; fix by giving "
                          f"the head's address as `ray start --head` printed it (host:port, port 6379 unless "
                          f"--port said otherwise) and checking that `ray status --address={address}` answers")
    if _asks_for_token(address):
        raise ConfigError(f"could not connect to the Ray cluster at RAY_ADDRESS={address}: its head asks for an "
                          f"authentication token (Ray's token authentication: it answered a call without one "
                          f"with InvalidAuthToken) and this process sends none; fix by exporting "
                          f"RAY_AUTH_MODE=token, with the head's token in ~/.ray/auth_token or RAY_AUTH_TOKEN")


def _uses_tls() -> bool:
    """Whether Ray's gRPC connections use TLS here (``RAY_USE_TLS``): the probes speak plain gRPC."""
    return os.environ.get("RAY_USE_TLS", "").strip().lower() in ("1", "true", "yes")


# a call every Ray head's GCS answers, and its empty request (GetClusterIdRequest has no fields)
_CLUSTER_ID_CALL = "/ray.rpc.NodeInfoGcsService/GetClusterId"


def _asks_for_token(address: str, timeout_s: float = CONNECT_PROBE_S) -> bool:
    """Whether the head at ``address`` refuses a call that carries no authentication token: Ray's
    own connect then retries for ~20 s and says only "Failed to connect" (Ray 2.60). Asked with
    one call (milliseconds) of the GCS's; not asked where this process sends a token
    (``RAY_AUTH_MODE=token``), over Ray Client (``ray://``), with TLS, or without grpcio."""
    where = _host_port(address)
    if (where is None or address.startswith("ray://") or _uses_tls()
            or os.environ.get("RAY_AUTH_MODE", "").strip().lower() == "token"):
        return False
    try:
        import grpc
    except ImportError:
        return False
    host, port = where
    with grpc.insecure_channel(f"[{host}]:{port}" if ":" in host else f"{host}:{port}") as channel:
        call = channel.unary_unary(_CLUSTER_ID_CALL, request_serializer=None, response_deserializer=None)
        try:
            call(b"", timeout=timeout_s)
        except grpc.RpcError as e:
            return e.code() == grpc.StatusCode.UNAUTHENTICATED
    return False


def _host_port(address: str) -> tuple[str, int] | None:
    """The host (an IPv6 one without its brackets) and port of ``host:port``, ``[v6]:port`` or
    ``ray://host:port``; None for an address that names no port (``auto``)."""
    m = re.fullmatch(r"(?:ray://)?\[?([^\[\]]+?)\]?:(\d+)", address)
    return None if m is None else (m.group(1), int(m.group(2)))


def _unreachable(address: str, timeout_s: float = CONNECT_PROBE_S) -> str | None:
    """Why nothing that could be a Ray head answers at ``address``'s host and port: nothing
    accepts a TCP connection there, or what does is not a gRPC server (None: it may be a head, or
    the address names no port to try: ``auto``)."""
    where = _host_port(address)
    if where is None:
        return None
    host, port = where
    if not 0 < port < 65536:
        return f"port {port} is not a TCP port"
    try:
        connection = socket.create_connection((host, port), timeout=timeout_s)
    except socket.gaierror:
        return f"host {host} is unknown here"
    except ConnectionRefusedError:
        return f"nothing listens at {host}:{port}"
    except OSError as e:   # a timeout, an unreachable network
        return f"{host}:{port} did not answer in {timeout_s:g} s ({e.strerror or type(e).__name__})"
    with connection:
        return _not_grpc(connection, f"{host}:{port}", timeout_s)


def _not_grpc(connection: socket.socket, where: str, timeout_s: float) -> str | None:
    """Why what listens at ``where`` is not a Ray head (None: it may be). A head's GCS, and the
    Ray Client server of ``ray://``, speak gRPC: an HTTP/2 server answers a client's connection
    preface with a SETTINGS frame. Ray's connect to anything else (its dashboard's HTTP port, an
    unrelated service) waited on it for minutes. Not asked with TLS (``RAY_USE_TLS``), where the
    first bytes are a TLS handshake."""
    if _uses_tls():
        return None
    reply = b""
    try:
        connection.settimeout(timeout_s)
        connection.sendall(_HTTP2_PREFACE)
        for _ in range(8):   # a frame header's first 4 bytes, however the reply is split
            part = connection.recv(64)
            reply += part
            if not part or len(reply) >= 4:
                break
    except socket.timeout:
        if not reply:
            return (f"something listens at {where} but answered nothing in {timeout_s:g} s (a Ray head's GCS "
                    f"answers at once)")
    except OSError as e:
        return f"something listens at {where} but dropped the connection ({e.strerror or type(e).__name__})"
    if len(reply) >= 4 and reply[3] == _SETTINGS:
        return None
    # a status line, or an error page without one (Python's http.server to an HTTP/2 preface)
    if reply.startswith(b"HTTP/") or reply.lstrip()[:9].lower().startswith((b"<!doctype", b"<html")):
        return (f"an HTTP server answers at {where}, not a Ray head (Ray's dashboard, port 8265, takes `ray job "
                f"submit`; a driver connects to the head's GCS port, 6379 unless `ray start --head --port` said "
                f"otherwise)")
    said = f"answered {reply[:24]!r}" if reply else "closed the connection"
    return f"something listens at {where} but it is not a Ray head (it {said}, where a head's GCS speaks gRPC)"


def _auth_hint() -> str:
    """What to try when a token is at hand but this process does not send it: ``ray start
    --head`` turns token authentication on by itself where ``~/.ray/auth_token`` exists, while a
    driver connecting to it with ``RAY_AUTH_MODE`` unset sends no token (Ray 2.5x), and the
    connection fails with nothing but "Failed to connect"."""
    if os.environ.get("RAY_AUTH_MODE", "").strip().lower() == "token":
        return ""
    token = (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
             or os.path.exists(os.path.expanduser("~/.ray/auth_token")))
    if not token:
        return ""
    return ("; if the cluster uses token authentication (`ray start --head` turns it on where ~/.ray/auth_token "
            "exists), export RAY_AUTH_MODE=token so that this process sends the token")


def ray_cluster(text: str = "ray") -> ClusterSpec:
    """The ClusterSpec of the Ray cluster at ``$RAY_ADDRESS`` (or the one this process is
    connected to); ``text`` may carry options (``ray?workers=2``)."""
    import ray

    options = parse_options(text)
    connect()
    nodes = ray.nodes()
    measured = {} if "gpu_gib" in options else probe_gpu_memory(nodes, command=NVIDIA_SMI)
    return describe_nodes(nodes, workers=options.get("workers"), gbps=options.get("gbps", DEFAULT_GBPS),
                          intra_gbps=options.get("intra_gbps"), gpu_gib=options.get("gpu_gib"), gpu_mib=measured)
