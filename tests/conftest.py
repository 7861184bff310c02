"""Shared fixtures. Ray is started once per test session, and only by tests that ask for it.

Honest markers: a test that starts Ray or TensorFlow carries ``@pytest.mark.integration`` (or
``multinode``), so ``pytest -m "not integration"`` is the fast suite. This is enforced: while an
unmarked test runs, importing ``tensorflow``, ``keras`` or ``ray`` (not yet loaded) raises, in
the test's process and in the Python subprocesses it starts (``tests/heavy_guard`` comes first
on their PYTHONPATH); an unmarked test that asks for ``ray_session`` is a collection error.
"""
from __future__ import annotations

import importlib.abc
import os
import sys

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Ray starts its workers at nice 15 (its ``worker_niceness``), so anything else busy on the machine
# at nice 0, such as a second pytest process under ``-n 2``, leaves them a few per cent of a core
# (measured: 3.6 % against two busy loops) and time-limited tests fail. Tests run them at nice 0.
os.environ.setdefault("RAY_worker_niceness", "0")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "configs")
HEAVY = ("tensorflow", "keras", "ray")
GUARD_DIR = os.path.join(REPO, "tests", "heavy_guard")


# set by .ci/run: there the multinode tests must run, so a machine that cannot host the testbed fails them
REQUIRE_MULTINODE_ENV = "AUTOSYNC_REQUIRE_MULTINODE"
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21


def testbed_unavailable() -> str | None:
    """Why this machine cannot host the emulated testbed (network namespaces and tc qdiscs), or
    None when it can: not root, root without CAP_NET_ADMIN/CAP_SYS_ADMIN (a container), or no iproute2."""
    from autosync.testbed import netns

    if os.geteuid() != 0:
        return "the testbed needs root (it makes network namespaces and tc qdiscs); run pytest as root, as CI does"
    try:
        with open("/proc/self/status") as f:
            caps = int(next(ln.split()[1] for ln in f if ln.startswith("CapEff:")), 16)
    except (OSError, StopIteration, ValueError):
        caps = None   # cannot tell: let the testbed try
    if caps is not None and not (caps >> _CAP_NET_ADMIN & 1 and caps >> _CAP_SYS_ADMIN & 1):
        return ("root here lacks CAP_NET_ADMIN or CAP_SYS_ADMIN (a container?), which `ip netns` and tc need; "
                "run the container with --cap-add NET_ADMIN --cap-add SYS_ADMIN")
    missing = [t for t in ("ip", "tc") if not netns.find_tool(t)]
    if missing:
        return f"the testbed needs iproute2 ({', '.join(missing)} missing): apt-get install iproute2"
    return None


def require_testbed_host() -> None:
    """Skip a multinode test, saying why, where this machine cannot host the testbed; fail it
    instead where ``AUTOSYNC_REQUIRE_MULTINODE=1`` (CI), so that CI never passes by skipping them."""
    reason = testbed_unavailable()
    if reason is None:
        return
    if os.environ.get(REQUIRE_MULTINODE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_MULTINODE_ENV}=1: the multinode tests must run here)")
    pytest.skip(f"multinode: {reason}")


def _marked(item) -> bool:
    return item.get_closest_marker("integration") is not None


class _HeavyImportGuard(importlib.abc.MetaPathFinder):
    def __init__(self, test: str):
        self.test = test

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in HEAVY and top not in sys.modules:
            raise ImportError(f"{self.test} imports {top} but is not marked @pytest.mark.integration: mark it, or "
                              f"keep the fast suite free of Ray and TensorFlow")
        return None


@pytest.hookimpl(optionalhook=True)   # xdist's hook: unknown when xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n N`` (the README's test command), every test of a module with multinode tests
    runs in one process, one after the other, beside the other tests: one testbed at a time, since
    its namespaces, bridge and subnet have fixed names. Every other test is scheduled on its own.

    (xdist's ``loadgroup`` would say this with markers, but under this pytest it schedules the
    tests of one group on different processes.) Another ``--dist`` than the default is left alone."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath
    has_multinode: dict[str, bool] = {}   # test module path -> whether it has multinode tests

    class TestbedOnce(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path not in has_multinode:
                try:
                    has_multinode[path] = "pytest.mark.multinode" in (root / path).read_text()
                except OSError:
                    has_multinode[path] = False
            return "testbed" if has_multinode[path] else nodeid

    return TestbedOnce(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:   # the testbed runs Ray: a multinode test is an integration test too (before -m selects)
        if item.get_closest_marker("multinode") and not item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.integration)
    bad = [i.nodeid for i in items if "ray_session" in getattr(i, "fixturenames", ()) and not _marked(i)]
    if bad:
        raise pytest.UsageError("tests start Ray without @pytest.mark.integration: " + ", ".join(bad))


def _guarded(item):
    if _marked(item):
        return None
    guard = _HeavyImportGuard(item.nodeid)
    sys.meta_path.insert(0, guard)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([GUARD_DIR] + ([old] if old else []))
    return guard, old


def _unguard(state) -> None:
    if state is None:
        return
    guard, old = state
    sys.meta_path.remove(guard)
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    state = _guarded(item)
    yield
    _unguard(state)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    state = _guarded(item)
    yield
    _unguard(state)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole session (4 logical CPUs on this 2-core machine:
    two workers plus parameter-server actors)."""
    import ray

    if not ray.is_initialized():
        # address="local": always a fresh private instance, never a cluster that `ray start` (a
        # testbed, another job) left recorded on this machine
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
                 object_store_memory=500 * 1024 * 1024)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def pool(ray_session):
    """Warm workers on the two-node ``PAIR`` cluster, shared by every runtime module of the session
    (a module that needs another cluster defines its own ``pool``). One pool per session, not per
    module: each fresh pool paid its workers' start (TensorFlow imported, the first model built)
    again, ~25 s per module on each xdist worker; the pool reloads, regroups and restarts its
    workers as each session needs (``WorkerPool.ensure``, ``collective_group``)."""
    from tests.runtime_helpers import PAIR, warm_pool

    for shared in warm_pool(ray_session, PAIR):
        _SHARED_POOLS.append(shared)
        yield shared
        _SHARED_POOLS.remove(shared)


_SHARED_POOLS: list = []


@pytest.fixture(scope="module", autouse=True)
def _release_shared_pool(request):
    """Before a module that uses the session's Ray without the shared ``pool`` (its own pool or
    actors), the shared pool's idle workers are stopped: each holds a CPU of the session's Ray,
    which that module's actors may need; the pool starts them again when next used."""
    mine = [i for i in request.session.items if getattr(i, "module", None) is request.module]
    own = callable(getattr(request.module, "pool", None))   # a module's own ``pool`` fixture
    if _SHARED_POOLS and any("ray_session" in i.fixturenames and (own or "pool" not in i.fixturenames)
                             for i in mine):
        for shared in _SHARED_POOLS:
            shared.kill_all()
    yield


@pytest.fixture(scope="session")
def configs_dir() -> str:
    return CONFIGS
