"""Where a running testbed is recorded, and the ClusterSpec that ``--cluster testbed`` loads.

The state folder (``/tmp/autosync-testbed``, or ``$AUTOSYNC_TESTBED_DIR``) holds:

- ``state.json``: what ``up`` made (namespaces, Ray temp folder, configuration, phase). It is
  written *before* anything is created, so ``down`` can always find what to remove;
- ``cluster.yaml``: the ClusterSpec, written only once every Ray node is alive;
- ``logs/``: the output of each ``ray start``.

Both files are written atomically (temp file + ``os.replace``).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from autosync.host_memory import machine_memory_gib
from strategy_space import ClusterSpec, NodeSpec
from strategy_space.errors import ConfigError
from strategy_space.yaml_io import atomic_write_text, load_cluster_spec as _load_yaml, save

from .config import SWITCH_NS, TestbedConfig, head_address, host_address, host_ns, rate_gbps
from .netns import namespace_exists

ENV_DIR = "AUTOSYNC_TESTBED_DIR"
DEFAULT_DIR = "/tmp/autosync-testbed"
STATE_FILE = "state.json"
CLUSTER_FILE = "cluster.yaml"
CLUSTER_NAME = "testbed"
STATE_VERSION = 1
NOT_UP = "no testbed is up; run `autosync testbed up`"
# Ray puts AF_UNIX sockets under <temp-dir>/session_<date>_<pid>/sockets/; the kernel limits
# their paths to 107 bytes, so the temp folder itself must stay short.
_MAX_RAY_TEMP_LEN = 40


def state_dir() -> Path:
    """The state folder: ``$AUTOSYNC_TESTBED_DIR`` or ``/tmp/autosync-testbed`` (read per call)."""
    return Path(os.environ.get(ENV_DIR) or DEFAULT_DIR)


def ray_temp_root(directory: Path) -> Path:
    """Folder for the Ray nodes' ``--temp-dir``s: inside the state folder when its path is short,
    else a short ``/tmp/astb-<hash>`` derived from it."""
    inside = directory / "ray"
    if len(str(inside)) <= _MAX_RAY_TEMP_LEN:
        return inside
    digest = hashlib.sha1(str(directory.resolve()).encode()).hexdigest()[:10]
    return Path(f"/tmp/astb-{digest}")


@dataclass(frozen=True)
class TestbedState:
    """What one ``up`` made.

    Attributes:
        config: the testbed's shape; ``bandwidth`` follows ``shape``.
        phase: ``starting`` until every Ray node is alive, then ``up``.
        switch: the switch namespace.
        namespaces: host namespaces, host0 first.
        ray_address: ``ip:port`` of the Ray head.
        ray_temp_root: parent of the nodes' Ray temp folders (removed by ``down``).
        created_at: UNIX time ``up`` began.
        up_seconds: how long ``up`` took (None while starting).
    """

    __test__ = False

    config: TestbedConfig
    phase: str = "starting"
    switch: str = SWITCH_NS
    namespaces: tuple[str, ...] = ()
    ray_address: str = field(default_factory=head_address)
    ray_temp_root: str = ""
    created_at: float = field(default_factory=time.time)
    up_seconds: float | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["namespaces"] = list(self.namespaces)
        d["version"] = STATE_VERSION
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "TestbedState":
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"state version {data.get('version')!r}, expected {STATE_VERSION}")
        data = dict(data)
        data.pop("version")
        data["config"] = TestbedConfig(**data["config"])   # (lists read back as the tuples they were)
        data["namespaces"] = tuple(data["namespaces"])
        return cls(**data)

    @property
    def all_namespaces(self) -> tuple[str, ...]:
        """Every namespace this testbed owns: hosts, then the switch."""
        return (*self.namespaces, self.switch)


def new_state(config: TestbedConfig, directory: Path | None = None) -> TestbedState:
    """The state of a testbed about to be made in ``directory`` (default: ``state_dir()``)."""
    directory = directory or state_dir()
    return TestbedState(config=config, namespaces=config.namespaces,
                        ray_temp_root=str(ray_temp_root(directory)))


def save_state(st: TestbedState, directory: Path | None = None) -> None:
    directory = directory or state_dir()
    atomic_write_text(directory / STATE_FILE, json.dumps(st.to_dict(), indent=2) + "\n")


def load_state(directory: Path | None = None) -> TestbedState | None:
    """The recorded testbed, or None when there is none.

    Raises:
        ConfigError: the state file exists but cannot be read.
    """
    path = (directory or state_dir()) / STATE_FILE
    if not path.exists():
        return None
    try:
        return TestbedState.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"testbed state file {path} is unreadable ({e}); run `autosync testbed down` "
                          f"to remove whatever it made, then `autosync testbed up`") from None


def clear(directory: Path | None = None) -> None:
    """Remove the state and cluster files (the logs stay for post-mortems)."""
    directory = directory or state_dir()
    for name in (CLUSTER_FILE, STATE_FILE):
        try:
            (directory / name).unlink()
        except FileNotFoundError:
            pass


def cluster_spec(config: TestbedConfig) -> ClusterSpec:
    """The ClusterSpec of a testbed: ``host0..`` with their 10.77.0.x addresses, their workers and
    link rates, the custom resource ``hostI`` for pinning, host0 as chief, and the machine's memory
    they share."""
    nodes = tuple(
        NodeSpec(name=host_ns(i), address=host_address(i), cpus=config.cpus_per_node, gpus=0,
                 workers=workers, chief=(i == 0), bandwidth_gbps=rate_gbps(bps), resource=host_ns(i))
        for i, (workers, bps) in enumerate(zip(config.workers_of, config.rates_bps))
    )
    # every host is a network namespace of this machine: what they hold together must fit its memory
    return ClusterSpec(name=CLUSTER_NAME, nodes=nodes, compute_dilation=config.compute_dilation,
                       shared_memory_gib=machine_memory_gib())


def mark_up(st: TestbedState, up_seconds: float, directory: Path | None = None) -> TestbedState:
    """Record that every node is alive: write ``cluster.yaml``, then the state with phase ``up``."""
    directory = directory or state_dir()
    save(cluster_spec(st.config), directory / CLUSTER_FILE)
    st = replace(st, phase="up", up_seconds=round(up_seconds, 3))
    save_state(st, directory)
    return st


def set_bandwidth(st: TestbedState, bandwidth: str, directory: Path | None = None) -> TestbedState:
    """Record a new link rate in the state and the ClusterSpec."""
    directory = directory or state_dir()
    st = replace(st, config=replace(st.config, bandwidth=bandwidth, node_bandwidths=()))
    save_state(st, directory)
    if st.phase == "up":
        save(cluster_spec(st.config), directory / CLUSTER_FILE)
    return st


def load_cluster_spec(directory: Path | None = None) -> ClusterSpec:
    """The ClusterSpec of the running testbed (what ``--cluster testbed`` resolves to).

    Raises:
        ConfigError: no testbed is up, it is still starting or half made, or its namespaces are
            gone (e.g. after a reboot).
    """
    directory = directory or state_dir()
    st = load_state(directory)
    if st is None:
        raise ConfigError(NOT_UP)
    if st.phase != "up" or not (directory / CLUSTER_FILE).exists():
        raise ConfigError(f"the testbed in {directory} is not up (phase {st.phase!r}): it is starting or was "
                          f"left half made; wait for `autosync testbed up` to finish, or run "
                          f"`autosync testbed down` and then `autosync testbed up`")
    missing = [ns for ns in st.all_namespaces if not namespace_exists(ns)]
    if missing:
        raise ConfigError(f"the testbed recorded in {directory} is stale: namespaces {', '.join(missing)} are "
                          f"gone; run `autosync testbed down` and then `autosync testbed up`")
    return _load_yaml(directory / CLUSTER_FILE)
