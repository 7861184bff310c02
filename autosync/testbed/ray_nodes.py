"""The Ray side of the testbed: one ``ray start`` per host namespace, a bounded wait until all
nodes are alive, and a stop that signals exactly the processes inside our namespaces.

Pitfalls handled here (all measured):

- ``ray stop`` and ``address="auto"`` see every Ray on the machine (PIDs are not namespaced), so
  ``RAY_ADDRESS`` is pinned and nodes are stopped by the PIDs ``ip netns pids`` lists.
- ``ray start --head`` turns token auth on by itself when ``~/.ray/auth_token`` exists, but
  ``ray start --address`` does not, and workers then fail with ``InvalidAuthToken``: the auth
  mode is always set explicitly (``disabled``: the LAN is reachable only from its namespaces).
- ``gcs_server`` ignores SIGTERM: SIGKILL follows after a grace period.
- Ray's AF_UNIX socket paths are limited to 107 bytes: ``--temp-dir`` is kept short.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from strategy_space.errors import ConfigError

from .config import HEAD_PORT, TestbedConfig, TestbedError, head_address, host_address, host_ns
from .netns import find_tool, pids

AUTH_MODE = "disabled"
HEAD_START_TIMEOUT_S = 60.0
_LOG_TAIL = 1500


def ray_executable() -> str:
    """The ``ray`` launcher of the Python running this code (so nodes run the same Ray).

    Raises:
        ConfigError: the environment of ``sys.executable`` has no ``ray`` launcher.
    """
    # not resolved: a venv's python is a symlink to the base interpreter, whose folder has no ray
    path = os.path.join(os.path.dirname(sys.executable), "ray")
    if not os.access(path, os.X_OK):
        raise ConfigError(f"no `ray` executable next to {sys.executable} ({path}); install Ray into the "
                          f"environment you run autosync from: `{sys.executable} -m pip install 'ray[default]'`")
    return path


def testbed_env(state_dir: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for every process of the testbed: Ray nodes, drivers, ``testbed exec``."""
    env = dict(os.environ if base is None else base)
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(key, None)
    env.update({
        "RAY_ADDRESS": head_address(),
        "RAY_AUTH_MODE": AUTH_MODE,
        "RAY_USAGE_STATS_ENABLED": "0",
        # gloo picks its interface from the hostname otherwise, which resolves to an address
        # that does not exist inside the namespace
        "GLOO_SOCKET_IFNAME": "eth0",
        "AUTOSYNC_TESTBED_DIR": str(state_dir),
    })
    return env


def in_namespace(ns: str, cmd: Sequence[str]) -> list[str]:
    """``cmd`` prefixed to run inside network namespace ``ns``."""
    return [find_tool("ip") or "ip", "netns", "exec", ns, *cmd]


def _start_command(i: int, config: TestbedConfig, temp_root: Path) -> list[str]:
    cmd = [
        ray_executable(), "start",
        f"--node-ip-address={host_address(i)}",
        f"--num-cpus={config.cpus_per_node}",
        "--num-gpus=0",
        f"--resources={json.dumps({host_ns(i): 1})}",
        f"--object-store-memory={config.object_store_mb * 1024 * 1024}",
        f"--temp-dir={temp_root / f'h{i}'}",
        "--disable-usage-stats",
    ]
    if i == 0:
        cmd += ["--head", f"--port={HEAD_PORT}", "--include-dashboard=false"]
    else:
        cmd += [f"--address={head_address()}"]
    return in_namespace(host_ns(i), cmd)


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-_LOG_TAIL:]
    except OSError:
        return "(no log)"


def start_nodes(config: TestbedConfig, temp_root: Path, log_dir: Path, env: Mapping[str, str],
                timeout_s: float) -> None:
    """``ray start`` the head in host0, then every worker node in parallel.

    Raises:
        TestbedError: a ``ray start`` failed or did not return in time (with its log's tail).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    temp_root.mkdir(parents=True, exist_ok=True)
    _start_and_wait([0], config, temp_root, log_dir, env, min(timeout_s, HEAD_START_TIMEOUT_S))
    _start_and_wait(range(1, config.nodes), config, temp_root, log_dir, env, timeout_s)


def _start_and_wait(indices: Iterable[int], config: TestbedConfig, temp_root: Path, log_dir: Path,
                    env: Mapping[str, str], timeout_s: float) -> None:
    procs = {}
    for i in indices:
        log = log_dir / f"ray_start_host{i}.log"
        with open(log, "w") as f:
            procs[i] = (subprocess.Popen(_start_command(i, config, temp_root), stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=dict(env)), log)
    deadline = time.monotonic() + timeout_s
    failed = []
    for i, (proc, log) in procs.items():
        try:
            rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            rc = None
        if rc != 0:
            why = "timed out" if rc is None else f"exit {rc}"
            failed.append(f"`ray start` in {host_ns(i)} {why}; end of {log}:\n{_tail(log)}")
    if failed:
        raise TestbedError("\n".join(failed))


def probe(env: Mapping[str, str], expect: int = 0, timeout_s: float = 60.0) -> dict:
    """Ask the Ray head, from a driver inside host0, which nodes are alive.

    Args:
        env: the testbed environment (``testbed_env``).
        expect: wait until at least this many nodes are alive.
        timeout_s: longest wait for ``expect`` nodes.

    Returns:
        ``{"alive": [{"address", "resources"}, ...], "dead": n, "ok": bool}``.

    Raises:
        TestbedError: the driver could not connect at all.
    """
    cmd = in_namespace(host_ns(0), [sys.executable, "-m", "autosync.testbed._probe",
                                    "--expect", str(expect), "--timeout", str(timeout_s)])
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=dict(env), timeout=timeout_s + 60)
    except subprocess.TimeoutExpired:
        raise TestbedError(f"the Ray probe in host0 did not finish within {timeout_s + 60:.0f} s") from None
    lines = res.stdout.strip().splitlines()
    if res.returncode not in (0, 3) or not lines:
        raise TestbedError(f"cannot reach the Ray head at {head_address()} from host0 "
                           f"(exit {res.returncode}): {res.stderr.strip()[-_LOG_TAIL:]}")
    out = json.loads(lines[-1])
    out["ok"] = res.returncode == 0
    return out


def stop_processes(namespaces: Sequence[str], grace_s: float = 3.0) -> dict[str, int]:
    """Stop every process living in ``namespaces``: SIGTERM, then SIGKILL after ``grace_s``.

    Only PIDs that ``ip netns pids`` lists for these namespaces are signalled, never this process.

    Returns:
        ``{"terminated": n, "killed": m, "left": k}`` (``left`` > 0 only if SIGKILL did not work
        within 5 s).
    """
    counts = {"terminated": 0, "killed": 0, "left": 0}
    for sig, key, wait_s in ((signal.SIGTERM, "terminated", grace_s), (signal.SIGKILL, "killed", 5.0)):
        targets = _pids_in(namespaces)
        if not targets:
            return counts
        for pid in targets:
            try:
                os.kill(pid, sig)
                counts[key] += 1
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while _pids_in(namespaces) and time.monotonic() < deadline:
            time.sleep(0.1)
    counts["left"] = len(_pids_in(namespaces))
    return counts


def _pids_in(namespaces: Sequence[str]) -> list[int]:
    me = os.getpid()
    return [p for ns in namespaces for p in pids(ns) if p != me]


def process_memory(namespaces: Sequence[str]) -> dict[str, dict]:
    """Resident memory of the processes in each namespace.

    Returns:
        ``{ns: {"processes": n, "rss_mib": float, "top": [(name, rss_mib), ...]}}``, ``top``
        holding the five largest processes.
    """
    out = {}
    for ns in namespaces:
        procs = []
        for pid in pids(ns):
            name, rss_kib = _proc_status(pid)
            if name is not None:
                procs.append((name, rss_kib / 1024))
        procs.sort(key=lambda p: -p[1])
        out[ns] = {"processes": len(procs), "rss_mib": round(sum(r for _, r in procs), 1),
                   "top": [(n, round(r, 1)) for n, r in procs[:5]]}
    return out


def _proc_status(pid: int) -> tuple[str | None, float]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None, 0.0
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    rss = fields.get("VmRSS", "0 kB").split()[0]
    return fields.get("Name", "?").strip(), float(rss)
