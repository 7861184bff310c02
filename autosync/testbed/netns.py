"""The emulated LAN: network namespaces on a bridge, and tc shaping of every link.

Layout (nothing is added to the root namespace; the hosts have no default route)::

    autosync-sw (namespace): bridge br0 --+-- veth0 <=> eth0 [host0] 10.77.0.1
                                          +-- veth1 <=> eth0 [host1] 10.77.0.2 ...

Egress of ``hostI:eth0`` is host I's upload; egress of ``autosync-sw:vethI`` is its download.
Each is limited by its own HTB class, so every host has the full rate in each direction.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Sequence

from strategy_space.errors import ConfigError

from .config import BRIDGE, GSO_MAX, SUBNET_PREFIX, TestbedError, burst_bytes, gso_bytes, host_address, host_ns

NETNS_DIR = Path("/run/netns")
_SBIN = "/usr/local/sbin:/usr/sbin:/sbin"
_CMD_TIMEOUT_S = 30
# HTB's default quantum is rate / r2q: far too big at Gbit rates (a kernel warning and bursty
# sharing); 60000 bytes is a few full-size packets.
HTB_QUANTUM = 60000


def switch_port(i: int) -> str:
    """Name of host ``i``'s veth end inside the switch namespace."""
    return f"veth{i}"


def find_tool(name: str) -> str | None:
    """Path of an iproute2 tool, also looking in the sbin folders a user's PATH may lack."""
    path = os.environ.get("PATH", "") + os.pathsep + _SBIN
    return shutil.which(name, path=path)


def check_requirements() -> dict[str, str]:
    """Check that this process can build the LAN.

    Returns:
        ``{"ip": path, "tc": path}``.

    Raises:
        ConfigError: not root, or ``ip``/``tc`` missing, with how to fix it.
    """
    problems = []
    if os.geteuid() != 0:
        problems.append("the testbed needs root: it creates network namespaces and tc qdiscs "
                        "(CAP_NET_ADMIN); run it as root, e.g. `sudo autosync testbed up`")
    tools = {name: find_tool(name) for name in ("ip", "tc")}
    missing = [name for name, path in tools.items() if path is None]
    if missing:
        problems.append(f"the testbed needs the iproute2 tools, but {' and '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} not installed; install them "
                        f"(Debian/Ubuntu: `apt-get install iproute2`)")
    if problems:
        raise ConfigError(problems)
    return tools  # type: ignore[return-value]


def run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Run one ``ip``/``tc``/``bridge`` command, bounded in time.

    Raises:
        TestbedError: the command failed (with ``check``) or did not finish in 30 s.
    """
    tool = find_tool(args[0]) or args[0]
    try:
        res = subprocess.run([tool, *args[1:]], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise TestbedError(f"`{' '.join(args)}` did not finish within {_CMD_TIMEOUT_S} s") from None
    if check and res.returncode != 0:
        raise TestbedError(f"`{' '.join(args)}` failed (exit {res.returncode}): {res.stderr.strip()}")
    return res


def list_namespaces() -> list[str]:
    """Names of all network namespaces known to ``ip netns`` (anyone's, not only ours)."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir())


def namespace_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def create_lan(switch: str, nodes: int, owner: str) -> None:
    """Create the switch namespace with its bridge and ``nodes`` host namespaces wired to it.

    Args:
        switch: name of the switch namespace.
        nodes: number of host namespaces (``host0..``).
        owner: the state folder of this testbed, kept as the bridge's alias so that ``down``
            can tell whose namespaces these are even when a state file is gone.

    Raises:
        TestbedError: a command failed; whatever was made so far is left for ``delete_namespace``.
    """
    run(["ip", "netns", "add", switch])
    run(["ip", "-n", switch, "link", "set", "lo", "up"])
    # no STP: ports forward at once
    run(["ip", "-n", switch, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0"])
    run(["ip", "-n", switch, "link", "set", BRIDGE, "alias", owner])
    run(["ip", "-n", switch, "link", "set", BRIDGE, "up"])
    for i in range(nodes):
        ns, port = host_ns(i), switch_port(i)
        run(["ip", "netns", "add", ns])
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        # both ends are created directly inside their namespaces: no name ever exists in the
        # root namespace, so nothing there can clash or leak
        run(["ip", "link", "add", port, "netns", switch, "type", "veth", "peer", "name", "eth0", "netns", ns])
        run(["ip", "-n", switch, "link", "set", port, "master", BRIDGE])
        run(["ip", "-n", switch, "link", "set", port, "up"])
        run(["ip", "-n", ns, "addr", "add", f"{host_address(i)}/24", "dev", "eth0"])
        run(["ip", "-n", ns, "link", "set", "eth0", "up"])
    _wait_forwarding(switch, nodes)


def _wait_forwarding(switch: str, nodes: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    for _ in range(200):
        out = run(["bridge", "-n", switch, "link", "show"], check=False).stdout
        if out.count("state forwarding") >= nodes:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    raise TestbedError(f"bridge ports in {switch} are not forwarding after {timeout_s:.0f} s:\n{out}")


def shape(switch: str, rates: Sequence[int | None]) -> None:
    """Limit host ``i``'s link to ``rates[i]`` bit/s in each direction (None: remove its limits)."""
    for i, bps in enumerate(rates):
        _shape_device(host_ns(i), "eth0", bps)
        _shape_device(switch, switch_port(i), bps)


def _shape_device(ns: str, dev: str, bps: int | None) -> None:
    # a veth starts with no root qdisc ("noqueue"); deleting it then fails, which is fine
    run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
    # super-packets small enough for the bucket (``config.gso_bytes``); unshaped: the kernel's most
    run(["ip", "-n", ns, "link", "set", "dev", dev, "gso_max_size", str(GSO_MAX if bps is None else gso_bytes(bps))])
    if bps is None:
        return
    burst = str(burst_bytes(bps))
    run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])
    run(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
         "rate", f"{bps}bit", "ceil", f"{bps}bit", "quantum", str(HTB_QUANTUM),
         "burst", burst, "cburst", burst])


def link_rate(ns: str, dev: str) -> str:
    """What tc says limits ``dev`` in ``ns``: e.g. ``htb rate 1Gbit ceil 1Gbit``, or ``unshaped``."""
    res = run(["tc", "-n", ns, "class", "show", "dev", dev], check=False)
    for line in res.stdout.splitlines():
        if "1:10" in line:
            words = line.split()
            rate = words[words.index("rate") + 1] if "rate" in words else "?"
            ceil = words[words.index("ceil") + 1] if "ceil" in words else "?"
            return f"htb rate {rate} ceil {ceil}"
    return "unshaped" if res.returncode == 0 else f"unknown ({res.stderr.strip()})"


def lan_owner(switch: str) -> str | None:
    """The state folder recorded on the bridge of ``switch`` by ``create_lan`` (None: unknown)."""
    res = run(["ip", "-n", switch, "-j", "link", "show", BRIDGE], check=False)
    try:
        return json.loads(res.stdout)[0].get("ifalias") or None
    except (ValueError, IndexError, AttributeError):
        return None


def has_testbed_address(ns: str) -> bool:
    """Whether ``ns`` has an ``eth0`` on the testbed subnet (how ``down`` recognises a host
    namespace of a testbed whose state file is gone)."""
    res = run(["ip", "-n", ns, "-4", "-o", "addr", "show", "dev", "eth0"], check=False)
    return res.returncode == 0 and f"inet {SUBNET_PREFIX}" in res.stdout


def pids(ns: str) -> list[int]:
    """PIDs of the processes living in namespace ``ns`` (empty when it does not exist)."""
    if not namespace_exists(ns):
        return []
    res = run(["ip", "netns", "pids", ns], check=False)
    return [int(w) for w in res.stdout.split() if w.isdigit()]


def delete_namespace(ns: str) -> bool:
    """Delete ``ns`` (its veth ends and bridge go with it). Returns whether it existed."""
    if not namespace_exists(ns):
        return False
    run(["ip", "netns", "del", ns])
    return True


def current_namespace_is(ns: str) -> bool:
    """Whether this process itself runs inside namespace ``ns``."""
    try:
        return os.stat("/proc/self/ns/net").st_ino == os.stat(NETNS_DIR / ns).st_ino
    except OSError:
        return False
