"""Shared fixtures. Ray is started once per test session, and only by tests that ask for it."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "configs")


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
def configs_dir() -> str:
    return CONFIGS
