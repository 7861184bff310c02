"""Bring an emulated multi-node Ray cluster up and down: the orchestration of ``netns``,
``ray_nodes`` and ``state``.

The module-level functions act on the testbed recorded in a state folder and back the CLI;
``Testbed`` wraps them for tests and benchmarks::

    with Testbed(nodes=3, bandwidth="1gbit") as tb:
        tb.exec(["python", "bench.py"])
        tb.shape("200mbit")
"""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from strategy_space import ClusterSpec
from strategy_space.errors import ConfigError

from . import netns, ray_nodes, state
from .config import SWITCH_NS, TestbedConfig, TestbedError, format_rate, head_address, host_ns, parse_rate

GRACE_S = 3.0
START_TIMEOUT_S = 90.0
_HOST_RE = re.compile(r"^host\d+$")


@dataclass(frozen=True)
class DownReport:
    """What ``down`` did.

    Attributes:
        namespaces: namespaces deleted.
        processes: ``{"terminated", "killed", "left"}`` counts from stopping the processes.
        seconds: how long it took.
    """

    namespaces: tuple[str, ...]
    processes: dict
    seconds: float


def _dir(directory: str | Path | None) -> Path:
    # resolved: the path is also the LAN's owner tag, compared as text
    return (Path(directory) if directory is not None else state.state_dir()).resolve()


def _refuse_from_inside(namespaces: Sequence[str], action: str) -> None:
    for ns in namespaces:
        if netns.current_namespace_is(ns):
            raise ConfigError(f"`autosync testbed {action}` runs inside testbed namespace {ns} (through "
                              f"`testbed exec`?); run it from the machine's own namespace instead")


def _check_nothing_there(config: TestbedConfig, directory: Path) -> None:
    recorded = state.load_state(directory)
    if recorded is not None:
        raise ConfigError(f"a testbed is already up ({recorded.config.nodes} nodes at "
                          f"{recorded.config.links}, phase {recorded.phase}, state in {directory}); "
                          f"use it, or run `autosync testbed down` first")
    clashing = [ns for ns in (*config.namespaces, SWITCH_NS) if netns.namespace_exists(ns)]
    if clashing:
        owner = netns.lan_owner(SWITCH_NS) if SWITCH_NS in clashing else None
        if owner and owner != str(directory):
            how = f"the testbed of state folder {owner}; run `AUTOSYNC_TESTBED_DIR={owner} autosync testbed down`"
        elif owner:
            how = "a half-made testbed of this state folder; run `autosync testbed down`"
        else:
            how = "not made by autosync; remove them with `ip netns del NAME` if they are leftovers"
        raise ConfigError(f"network namespaces {', '.join(clashing)} already exist: {how}")


def up(config: TestbedConfig, directory: str | Path | None = None, start_timeout_s: float = START_TIMEOUT_S,
       progress: Callable[[str], None] | None = None) -> state.TestbedState:
    """Create the namespaces, shape the links, start one Ray node per host, wait until all are
    alive, then record the ClusterSpec.

    Args:
        config: the testbed's shape.
        directory: state folder (default ``state.state_dir()``).
        start_timeout_s: longest wait for the Ray nodes.
        progress: called with a short line as each phase begins (the CLI prints them).

    Returns:
        The recorded state, phase ``up``.

    Raises:
        ConfigError: not root, tools missing, or a testbed (or clashing namespaces) already there.
        TestbedError: something failed midway; everything made so far has been removed.
    """
    netns.check_requirements()
    ray_nodes.ray_executable()
    directory = _dir(directory)
    _check_nothing_there(config, directory)
    say = progress or (lambda line: None)
    t0 = time.monotonic()
    st = state.new_state(config, directory)
    # recorded before anything exists, so that `down` always knows what to remove
    state.save_state(st, directory)
    try:
        say(f"creating namespaces {', '.join(st.all_namespaces)} and shaping links to {config.links}")
        netns.create_lan(st.switch, config.nodes, owner=str(directory))
        netns.shape(st.switch, config.rates_bps)
        env = ray_nodes.testbed_env(directory)
        say(f"starting {config.nodes} Ray node(s), head in host0 (about 5-10 s each on a 2-core machine)")
        ray_nodes.start_nodes(config, Path(st.ray_temp_root), directory / "logs", env, start_timeout_s)
        say("waiting until every Ray node is alive")
        seen = ray_nodes.probe(env, expect=config.nodes, timeout_s=start_timeout_s)
        if not seen["ok"]:
            raise TestbedError(f"only {len(seen['alive'])} of {config.nodes} Ray nodes came alive within "
                               f"{start_timeout_s:.0f} s; see the logs in {directory / 'logs'} and "
                               f"{st.ray_temp_root}/h*/session_latest/logs")
        return state.mark_up(st, time.monotonic() - t0, directory)
    except BaseException as exc:
        try:
            down(directory)
        except Exception as cleanup:  # keep the first error; say that cleaning up failed too
            exc.add_note(f"cleaning up the half-made testbed failed as well: {cleanup}; "
                         f"run `autosync testbed down`")
        raise


def down(directory: str | Path | None = None, grace_s: float = GRACE_S) -> DownReport:
    """Stop every process inside the testbed's namespaces (by PID: SIGTERM, SIGKILL after
    ``grace_s``), delete the namespaces, the Ray temp folder and the state files.

    Idempotent; also cleans a half-made testbed. Without a state file it removes the switch
    namespace and the ``hostI`` namespaces that carry a testbed address.

    Raises:
        ConfigError: not root or tools missing, while there is something to remove; or called
            from inside a testbed namespace.
    """
    directory = _dir(directory)
    t0 = time.monotonic()
    st = state.load_state(directory)
    owned = _owned_namespaces(directory, st)
    if owned:
        netns.check_requirements()
        _refuse_from_inside(owned, "down")
    counts = ray_nodes.stop_processes(owned, grace_s) if owned else {"terminated": 0, "killed": 0, "left": 0}
    removed = tuple(ns for ns in owned if netns.delete_namespace(ns))
    if st is not None:
        temp = Path(st.ray_temp_root)
        if temp.name and (temp.parent == directory or temp.name.startswith("astb-")):
            shutil.rmtree(temp, ignore_errors=True)
        state.clear(directory)
    return DownReport(namespaces=removed, processes=counts, seconds=round(time.monotonic() - t0, 3))


def _owned_namespaces(directory: Path, st: state.TestbedState | None) -> list[str]:
    """The namespaces ``down`` may remove for the state folder ``directory``.

    Raises:
        ConfigError: nothing is recorded here but a live testbed of another state folder exists.
    """
    switch = st.switch if st is not None else SWITCH_NS
    if not netns.namespace_exists(switch):
        return [ns for ns in (st.namespaces if st else ()) if netns.namespace_exists(ns)]
    owner = netns.lan_owner(switch)
    if owner and owner != str(directory) and state.load_state(Path(owner)) is not None:
        if st is None:
            raise ConfigError(f"no testbed is recorded in {directory}; the running one belongs to state folder "
                              f"{owner}: run `AUTOSYNC_TESTBED_DIR={owner} autosync testbed down`")
        return []  # our record is stale; the namespaces now belong to that other testbed
    if st is not None:
        return [ns for ns in st.all_namespaces if netns.namespace_exists(ns)]
    # a testbed whose state file is gone: its switch and the hosts that carry testbed addresses
    hosts = [ns for ns in netns.list_namespaces() if _HOST_RE.match(ns) and netns.has_testbed_address(ns)]
    return [*hosts, switch]


def _require_up(directory: Path) -> state.TestbedState:
    st = state.load_state(directory)
    if st is None:
        raise ConfigError(state.NOT_UP)
    if st.phase != "up":
        raise ConfigError(f"the testbed in {directory} is not up (phase {st.phase!r}); run `autosync testbed down` "
                          f"and then `autosync testbed up`")
    return st


def shape(bandwidth: str, directory: str | Path | None = None) -> state.TestbedState:
    """Change every host's link rate at run time and record it in the ClusterSpec.

    Raises:
        ConfigError: a bad rate, no testbed up, or not root.
    """
    bps = parse_rate(bandwidth)
    directory = _dir(directory)
    st = _require_up(directory)
    netns.check_requirements()
    netns.shape(st.switch, [bps] * st.config.nodes)
    return state.set_bandwidth(st, format_rate(bps), directory)


def status(directory: str | Path | None = None, probe_ray: bool = True) -> dict:
    """What is there: the recorded state, namespaces, link rates, Ray nodes, process memory.

    Returns:
        ``{"state_dir", "state"}`` plus, when a testbed is recorded, ``"namespaces"``
        (``{ns: present}``), ``"links"`` (``{"hostI": {"upload", "download"}}``), ``"ray"`` (the
        probe's answer, or ``{"error": ...}``) and ``"memory"`` (see ``ray_nodes.process_memory``).
    """
    directory = _dir(directory)
    st = state.load_state(directory)
    out: dict = {"state_dir": str(directory), "state": st.to_dict() if st else None}
    if st is None:
        return out
    out["namespaces"] = {ns: netns.namespace_exists(ns) for ns in st.all_namespaces}
    out["links"] = {
        ns: {"upload": netns.link_rate(ns, "eth0"), "download": netns.link_rate(st.switch, netns.switch_port(i))}
        for i, ns in enumerate(st.namespaces) if out["namespaces"][ns]
    }
    if probe_ray and st.phase == "up" and all(out["namespaces"].values()):
        try:
            out["ray"] = ray_nodes.probe(ray_nodes.testbed_env(directory), expect=0, timeout_s=10)
        except TestbedError as e:
            out["ray"] = {"error": str(e)}
    out["memory"] = ray_nodes.process_memory(st.namespaces)
    return out


def exec_in_head(cmd: Sequence[str], directory: str | Path | None = None, *, capture: bool = False,
                 timeout_s: float | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` inside host0 with ``RAY_ADDRESS``, ``RAY_AUTH_MODE``, ``GLOO_SOCKET_IFNAME=eth0``
    and ``AUTOSYNC_TESTBED_DIR`` set.

    Args:
        cmd: program and arguments.
        directory: state folder.
        capture: capture stdout/stderr as text instead of passing them through.
        timeout_s: kill the command after this many seconds (None: no limit).

    Returns:
        The finished process (its ``returncode`` is the command's exit code).

    Raises:
        ConfigError: empty command, no testbed up, or not root.
        subprocess.TimeoutExpired: ``timeout_s`` passed.
    """
    if not cmd:
        raise ConfigError("give the command to run inside host0, e.g. `autosync testbed exec -- python train.py`")
    directory = _dir(directory)
    _require_up(directory)
    netns.check_requirements()
    return subprocess.run(ray_nodes.in_namespace(host_ns(0), list(cmd)), env=ray_nodes.testbed_env(directory),
                          capture_output=capture, text=capture or None, timeout=timeout_s)


class Testbed:
    """An emulated cluster for tests and benchmarks; a context manager that always tears down.

    Args:
        nodes: number of hosts.
        bandwidth: per-host rate each direction (``1gbit``, ``200mbit``, ``none``).
        cpus_per_node: ``--num-cpus`` of each Ray node.
        object_store_mb: object store per node, MiB.
        config: a whole TestbedConfig instead of the four above (e.g. from ``like_config``).
        state_dir: state folder (default ``$AUTOSYNC_TESTBED_DIR`` or ``/tmp/autosync-testbed``).

    Raises:
        ConfigError: invalid arguments.
    """

    __test__ = False

    def __init__(self, nodes: int = 3, bandwidth: str = "1gbit", cpus_per_node: int = 1,
                 object_store_mb: int = 1000, state_dir: str | Path | None = None, *,
                 config: TestbedConfig | None = None):
        self.config = config or TestbedConfig(nodes=nodes, bandwidth=bandwidth, cpus_per_node=cpus_per_node,
                                              object_store_mb=object_store_mb)
        self.state_dir = _dir(state_dir)
        self.state: state.TestbedState | None = None

    def up(self, start_timeout_s: float = START_TIMEOUT_S,
           progress: Callable[[str], None] | None = None) -> "Testbed":
        """Bring the testbed up (see ``up``); returns self."""
        self.state = up(self.config, self.state_dir, start_timeout_s, progress)
        return self

    def down(self, grace_s: float = GRACE_S) -> DownReport:
        """Tear it down (see ``down``); safe to call more than once."""
        self.state = None
        return down(self.state_dir, grace_s)

    def shape(self, bandwidth: str) -> None:
        """Change the link rate at run time."""
        self.state = shape(bandwidth, self.state_dir)
        self.config = self.state.config

    def status(self, probe_ray: bool = True) -> dict:
        return status(self.state_dir, probe_ray)

    def exec(self, cmd: Sequence[str], *, capture: bool = False,
             timeout_s: float | None = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` as a driver inside host0 (see ``exec_in_head``)."""
        return exec_in_head(cmd, self.state_dir, capture=capture, timeout_s=timeout_s)

    def env(self) -> dict[str, str]:
        """The environment ``exec`` gives its command (for your own ``ip netns exec``)."""
        return ray_nodes.testbed_env(self.state_dir)

    @property
    def cluster_spec(self) -> ClusterSpec:
        return state.load_cluster_spec(self.state_dir)

    @property
    def ray_address(self) -> str:
        """``ip:port`` of the Ray head (reachable only from inside the testbed's namespaces)."""
        return head_address()

    def __enter__(self) -> "Testbed":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()
