"""Bind a ClusterSpec onto a running Ray cluster: which Ray node each spec node is, and the
actor options that pin work there.

A node is found by its custom resource label (``NodeSpec.resource``) when set, else by its
address (Ray's ``node:<ip>`` resource). The ``local`` cluster (one node on the loopback address)
starts an embedded Ray when none is initialized. Missing nodes or CPUs fail early with a
ConfigError that says what was requested, what is available and how to fix it.
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field, replace

from autosync import signals
from strategy_space import ClusterSpec
from strategy_space.errors import ConfigError

LOOPBACK = ("127.0.0.1", "localhost")
# a pinning resource amount small enough for thousands of actors on one node
PIN_AMOUNT = 0.001


@dataclass(frozen=True)
class ClusterBinding:
    """A ClusterSpec mapped onto Ray nodes.

    Attributes:
        cluster: the spec.
        keys: node name -> the Ray resource that pins actors to it.
        node_ids: node name -> Ray node id.
        started_ray: this binding started the embedded Ray (and ``close`` stops it).
        reaper: the watchdog that stops the embedded Ray's processes if the driver is killed
            (``autosync.runtime.reaper``); None when this binding did not start Ray.
        ray_roots: pid -> start time of the processes ``ray.init`` started here (``close``
            stops what is left of them and theirs after ``ray.shutdown``).
        seen: the Ray node ids alive when it was bound: a node not among them joined since
            (``stand_ins``).
    """

    cluster: ClusterSpec
    keys: dict
    node_ids: dict
    started_ray: bool = False
    reaper: object = field(default=None, compare=False, repr=False)
    ray_roots: dict = field(default_factory=dict, compare=False, repr=False)
    seen: frozenset = field(default=frozenset(), compare=False, repr=False)

    @classmethod
    def bind(cls, cluster: ClusterSpec) -> "ClusterBinding":
        """Connect (or start the embedded Ray for a single loopback node) and check resources.

        Raises:
            ConfigError: Ray is not running for a multi-node spec, or a node, resource or the
                CPUs it asks for are not in the Ray cluster.
        """
        import ray

        started, reaper, roots = False, None, {}
        if not ray.is_initialized():
            started, reaper, roots = _start_ray(cluster)
        alive = [n for n in ray.nodes() if n.get("Alive")]
        try:
            keys, node_ids = _resolve(cluster, alive)
        except ConfigError:
            if started:
                _shutdown(reaper, roots)
            raise
        return cls(cluster=cluster, keys=keys, node_ids=node_ids, started_ray=started, reaper=reaper,
                   ray_roots=roots, seen=frozenset(n["NodeID"] for n in alive))

    def stand_ins(self, cluster: ClusterSpec) -> "tuple[ClusterSpec, dict] | None":
        """``cluster`` with Ray nodes that joined since this binding was made standing in for
        those of its nodes that Ray no longer has (``stand_ins``), and ``{node: new address}``;
        None where one has none (or none is gone)."""
        import ray

        try:
            alive = [n for n in ray.nodes() if n.get("Alive")]
        except Exception:  # noqa: BLE001 - Ray cannot say: no stand-in
            return None
        return stand_ins(cluster, alive, self.seen)

    def actor_options(self, node: str, num_cpus: float = 0.0, num_gpus: int = 0) -> dict:
        """``.options(...)`` keyword arguments that place an actor on ``node``, with ``num_gpus``
        GPUs of it (Ray then shows the actor those alone, ``CUDA_VISIBLE_DEVICES``).

        On a node with GPUs an actor given none is kept off them (``CUDA_VISIBLE_DEVICES`` empty):
        Ray leaves every GPU visible to an actor that asks for none, and TensorFlow, when a
        parameter server imports it, would take the memory of all of them from the workers.
        """
        options = {"num_cpus": num_cpus, "resources": {self.keys[node]: PIN_AMOUNT}}
        if num_gpus:
            options["num_gpus"] = num_gpus
        elif self.cluster.node(node).gpus > 0:
            options["runtime_env"] = {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}
        return options

    def slot_gpus(self, slot: str) -> int:
        """``slot_gpus`` of this binding's cluster."""
        return slot_gpus(self.cluster, slot)

    def worker_cpus(self, node: str) -> float:
        """CPUs for each worker on ``node``: the node's CPUs shared by its workers."""
        spec = self.cluster.node(node)
        return spec.cpus / max(1, spec.workers or 1)

    def lost_nodes(self) -> list[str]:
        """The spec's nodes whose Ray node has left the cluster since binding (Ray reports it dead,
        or no longer knows it), in spec order: nothing placed there runs again."""
        import ray

        try:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        except Exception:  # noqa: BLE001 - Ray cannot say (not connected, shutting down): none known lost
            return []
        return [name for name, node_id in self.node_ids.items() if node_id not in alive]

    def answering(self, nodes) -> bool:
        """Whether the Ray node of each of ``nodes`` (the spec's names) is alive to Ray and its
        raylet accepts a connection now (``accepts``): so that a failure is known for an ordinary
        one at once, where Ray's heartbeats take tens of seconds to report a node dead. A raylet
        that was killed refuses at once; a machine that is gone does not answer within the time-out:
        both are not answering."""
        import ray

        try:
            known = {n["NodeID"]: n for n in ray.nodes()}
        except Exception:  # noqa: BLE001 - Ray cannot say (not connected, shutting down)
            return False
        for name in nodes:
            node = known.get(self.node_ids.get(name))
            where = (node or {}).get("NodeManagerAddress"), (node or {}).get("NodeManagerPort")
            if not (node and node.get("Alive") and accepts(*where)):
                return False
        return True

    def lost_for(self, strategy) -> tuple[list[str], bool] | None:
        """The lost nodes (``lost_nodes``) ``strategy`` places workers or parameter servers on, and
        whether any of them held its workers (``lost_nodes_note``); None where it needs none."""
        lost = self.lost_nodes()
        workers = {s.rsplit(":", 1)[0] for s in strategy.resolved_replicas(self.cluster)}
        needed = [n for n in lost if n in workers or n in strategy.ps_nodes()]
        return (needed, any(n in workers for n in needed)) if needed else None

    def lost_note(self, nodes=None) -> str:
        """What the cluster has lost of ``nodes`` (every node: None), said by ``lost_nodes_note``,
        or "": a wait on actors being placed on ``nodes`` asks it (``waiting.wait_all``'s ``alive``),
        so that a node nothing there needs leaving does not fail it."""
        from tuner.records.trial import lost_nodes_note, workers_lost

        lost = [n for n in self.lost_nodes() if nodes is None or n in nodes]
        return lost_nodes_note(lost, bool(workers_lost(lost, self.cluster))) if lost else ""

    def close(self) -> None:
        """Stop the embedded Ray if this binding started it."""
        if self.started_ray:
            _shutdown(self.reaper, self.ray_roots)


def accepts(address, port, timeout_s: float = 1.0) -> bool:
    """Whether ``address:port`` accepts a TCP connection within ``timeout_s``."""
    import socket

    try:
        with socket.create_connection((str(address), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError, TypeError):
        return False


def _shutdown(reaper, roots: dict) -> None:
    """Stop the embedded Ray, its watchdog, and any of its processes the shutdown left running
    (agents still starting when a command is interrupted early: ``reaper.sweep``)."""
    import ray

    from autosync.runtime.reaper import ray_processes, sweep

    seen = ray_processes(roots)
    try:
        ray.shutdown()
    finally:
        _stop(reaper)
        sweep(seen)


def _stop(reaper) -> None:
    if reaper is not None and reaper.poll() is None:
        reaper.kill()
        reaper.wait()


def _is_local(cluster: ClusterSpec) -> bool:
    return len(cluster.nodes) == 1 and cluster.nodes[0].address in LOOPBACK and cluster.nodes[0].resource is None


# each worker is a process of its own (a TensorFlow runtime with real compute, a sleeping
# gradient source with emulated compute); more than this many per CPU only thrashes a node
WORKERS_PER_CPU = 8


def check_cluster_start(cluster: ClusterSpec) -> ClusterSpec:
    """``cluster``, once ``check_node_capacity`` passed and its Ray can be reached
    (``check_ray_reachable``): what a command checks before it reads the model.

    Raises:
        ConfigError: see those two.
    """
    check_node_capacity(cluster)
    check_ray_reachable(cluster)
    return cluster


def check_node_capacity(cluster) -> None:
    """Refuse, before Ray starts, a cluster whose nodes are given more workers than they can run.

    Raises:
        ConfigError: a node with more than ``WORKERS_PER_CPU`` workers per CPU (GPUs add one each).
    """
    over = [f"{n.name} ({n.workers} workers, {n.cpus} CPUs, {n.gpus} GPUs)" for n in cluster.nodes
            if (n.workers or 0) > WORKERS_PER_CPU * n.cpus + n.gpus]
    if over:
        raise ConfigError(f"cluster {cluster.name}: node(s) {', '.join(over[:5])} have more workers than they can run "
                          f"(each worker is a process; at most {WORKERS_PER_CPU} per CPU plus one per GPU); lower "
                          f"workers or give the node its real cpus")


def check_ray_reachable(cluster: ClusterSpec) -> None:
    """What ``_start_ray`` would refuse, said before a command reads the model (seconds of
    TensorFlow, minutes for a large one): a ``RAY_ADDRESS`` where no Ray head answers, or a
    cluster of other machines with no Ray to connect to. Nothing is asked of a process already
    connected (``ray.init`` called by the user).

    Raises:
        ConfigError: as ``_start_ray`` would.
    """
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address:
        from autosync.ray_cluster import check_address

        check_address(address)
    elif not _is_local(cluster):
        raise _no_ray(cluster)


def _no_ray(cluster: ClusterSpec) -> ConfigError:
    return ConfigError(f"cluster {cluster.name} has {len(cluster.nodes)} node(s) but Ray is not running here; "
                       f"fix by starting the Ray cluster and setting RAY_ADDRESS=<head>:6379 (or calling "
                       f"ray.init(address=...)) before running, or use cluster 'local'")


def _start_ray(cluster: ClusterSpec) -> tuple[bool, object, dict]:
    """Connect to RAY_ADDRESS, or start the embedded Ray for ``local``; returns (started, reaper,
    the processes ``ray.init`` started: pid -> start time)."""
    import ray

    from autosync.runtime.reaper import children, start_reaper

    if os.environ.get("RAY_ADDRESS"):
        from autosync.ray_cluster import connect

        connect()   # a cluster that does not answer is a ConfigError that says what to check
        return False, None, {}
    if not _is_local(cluster):
        raise _no_ray(cluster)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # started first, so its snapshots of the driver's descendants see Ray's processes as they appear
    reaper = start_reaper()
    before, roots = children(), {}
    # address="local": a fresh private instance, never a cluster some `ray start` left recorded
    try:
        # Ctrl-C or SIGTERM wait until Ray has started, then stop it whole (``signals.held``);
        # the caller's SIGTERM handler stays (Ray's would call sys.exit wherever the thread is)
        with signals.held():
            ray.init(address="local", num_cpus=cluster.nodes[0].cpus, include_dashboard=False,
                     logging_level="ERROR", log_to_driver=False)
            roots = {p: t for p, t in children().items() if before.get(p) != t}
    except BaseException:
        if ray.is_initialized():   # an interrupt that waited for the start
            _shutdown(reaper, roots)
        else:   # the start failed: what it started is stopped by the watchdog, which saw it appear
            from autosync.runtime.reaper import sweep_started

            with contextlib.suppress(Exception):
                ray.shutdown()
            sweep_started(reaper)
        raise
    signals.install()
    return True, reaper, roots


def stand_ins(cluster: ClusterSpec, alive: list, seen) -> "tuple[ClusterSpec, dict] | None":
    """``cluster`` with each node found by its address that no alive Ray node (``ray.nodes()``
    entries) has any more stood in for by one that joined since (its id not in ``seen``: an
    autoscaler's replacement, which comes with a new address) and has the CPUs and GPUs the node's
    workers ask for, in the order of their addresses, each at most once; and ``{node: its new
    address}``. None where a node that is gone has none, or is found by a resource label (its
    replacement carries the label: it is found as it is), or none is gone."""
    have = {k for n in alive for k in n["Resources"]}
    gone = [spec for spec in cluster.nodes if (spec.resource or f"node:{spec.address}") not in have]
    if not gone or any(spec.resource or spec.address in LOOPBACK for spec in gone):
        return None
    taken = {f"node:{spec.address}" for spec in cluster.nodes}
    joined = sorted((n for n in alive if n["NodeID"] not in seen and not taken & set(n["Resources"])),
                    key=lambda n: n["NodeManagerAddress"])
    moved = {}
    for spec in gone:
        fits = [n for n in joined if not _short_of(spec, n, cluster.compute == "emulated")]
        if not fits:
            return None
        joined.remove(fits[0])
        moved[spec.name] = fits[0]["NodeManagerAddress"]
    nodes = tuple(replace(spec, address=moved[spec.name]) if spec.name in moved else spec for spec in cluster.nodes)
    return replace(cluster, nodes=nodes), moved


def slot_gpus(cluster: ClusterSpec, slot: str) -> int:
    """GPUs a worker in ``slot`` (``node:i``) computes on: one for each of the node's first
    ``gpus`` slots (as Horovod and Ray Train give each worker its own GPU), none past them."""
    node, index = slot.rsplit(":", 1)
    return 1 if int(index) < cluster.node(node).gpus else 0


def _resolve(cluster: ClusterSpec, ray_nodes: list) -> tuple[dict, dict]:
    import ray

    problems = []
    keys, node_ids = {}, {}
    labels = sorted({k for n in ray_nodes for k in n["Resources"]
                     if not k.startswith(("node:", "CPU", "GPU", "memory", "object_store_memory", "accelerator_type"))})
    addresses = sorted({n["NodeManagerAddress"] for n in ray_nodes})
    for spec in cluster.nodes:
        if spec.resource:
            key = spec.resource
            fix = f"start that Ray node with --resources='{{\"{key}\": 1}}' or set node.resource to one of {labels or 'none'}"
        else:
            key = f"node:{spec.address}"
            if spec.address in LOOPBACK and not any(key in n["Resources"] for n in ray_nodes):
                # Ray may know this machine by its interface address: loopback means the driver's node
                key = f"node:{ray.util.get_node_ip_address()}"
            fix = f"set node.address to one of {addresses} or give node.resource (a custom Ray resource label)"
        matches = [n for n in ray_nodes if key in n["Resources"]]
        if not matches:
            problems.append(f"node {spec.name}: requested Ray resource '{key}', available nodes: "
                            f"addresses {addresses}, labels {labels or 'none'}; fix by: {fix}")
            continue
        if len(matches) > 1 and not spec.resource:
            problems.append(f"node {spec.name}: address {spec.address} matches {len(matches)} Ray nodes; "
                            f"fix by giving each node a custom resource label (node.resource)")
            continue
        ray_node = matches[0]
        short = _short_of(spec, ray_node, cluster.compute == "emulated")
        if short:
            problems.append(short)
            continue
        keys[spec.name] = key
        node_ids[spec.name] = ray_node["NodeID"]
    if problems:
        raise ConfigError(problems)
    return keys, node_ids


def _short_of(spec, ray_node: dict, emulated: bool) -> str:
    """What ``ray_node`` lacks of the CPUs and GPUs the workers of ``spec`` ask for, or "": each
    worker its share of the node's CPUs, and one GPU each for as many as the node has GPUs
    (``ClusterBinding.slot_gpus``; emulated workers take none)."""
    workers = spec.workers or 0
    gpus = 0 if emulated else min(spec.gpus, workers)
    for resource, needed, which, key in (("CPU", workers * spec.cpus / max(1, workers), f"{workers} worker(s)", "cpus"),
                                         ("GPU", gpus, f"one each of its first {gpus} worker(s)", "gpus")):
        have = ray_node["Resources"].get(resource, 0.0)
        if needed > have + 1e-9:
            return (f"node {spec.name}: requested {needed:g} {resource}s for {which}, available {have:g} on Ray node "
                    f"{ray_node['NodeManagerAddress']}; fix by lowering {key} in the cluster spec to <= {have:g} or "
                    f"starting Ray there with --num-{key}={needed:g}")
    return ""
