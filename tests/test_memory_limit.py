"""The driver's limit on the memory the user's code takes (``autosync.memory_limit``, applied by
``time_limit.bounded``): a block past its budget is stopped with a message that says what to
lower, the command line ends one that does not give control back, and the budget is read from the
machine (half of what is available), its cgroup or ``AUTOSYNC_MODEL_MEMORY``."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from autosync import memory_limit, time_limit
from strategy_space.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 8 << 20
# pytest-timeout's default method owns SIGALRM, which the limits leave to its owner: a thread instead
pytestmark = pytest.mark.timeout(300, method="thread")


@pytest.mark.parametrize("text, size", [("512m", 512 << 20), ("8G", 8 << 30), ("1048576", 1 << 20), ("1.5k", 1536),
                                        ("inf", None)])
def test_the_budget_a_user_sets(monkeypatch, text, size):
    monkeypatch.setenv(memory_limit.ENV, text)
    assert memory_limit.budget() == size


@pytest.mark.parametrize("text", ["lots", "-1g", "0", "nan", "infg"])
def test_a_budget_that_is_not_a_size_says_what_to_set(monkeypatch, text):
    monkeypatch.setenv(memory_limit.ENV, text)
    with pytest.raises(ConfigError, match=f"^{memory_limit.ENV} must be a size in bytes > 0, .*e.g. 8g.*got"):
        memory_limit.budget()


def test_the_default_budget_is_half_of_what_is_available(monkeypatch):
    monkeypatch.delenv(memory_limit.ENV, raising=False)
    monkeypatch.setattr(memory_limit, "available", lambda: (10 << 30, 20 << 30))
    assert memory_limit.budget() == 5 << 30
    monkeypatch.setattr(memory_limit, "available", lambda: None)   # a system that does not say
    assert memory_limit.budget() is None


def test_a_cgroups_limit_is_what_is_available_where_it_is_less(tmp_path, monkeypatch):
    """The tightest limit of the process's cgroup and its ancestors, v2 or v1 (a container's, a job's)."""
    monkeypatch.setattr(memory_limit, "_meminfo", lambda: {"MemAvailable": 20 << 30, "MemTotal": 24 << 30})
    monkeypatch.setattr(memory_limit, "_CGROUP", tmp_path)
    own = tmp_path / "proc-cgroup"
    monkeypatch.setattr(memory_limit, "_PROC_CGROUP", own)
    assert memory_limit.available() == (20 << 30, 24 << 30)   # no /proc/self/cgroup: the machine's
    own.write_text("0::/job/step\n")
    (tmp_path / "job" / "step").mkdir(parents=True)
    assert memory_limit.available() == (20 << 30, 24 << 30)   # no limit files: the machine's
    (tmp_path / "job" / "step" / "memory.max").write_text("max\n")
    (tmp_path / "job" / "memory.max").write_text(str(4 << 30))
    (tmp_path / "job" / "memory.current").write_text(str(1 << 30))
    assert memory_limit.available() == (3 << 30, 4 << 30)   # the parent's limit
    (tmp_path / "job" / "step" / "memory.max").write_text(str(2 << 30))
    (tmp_path / "job" / "step" / "memory.current").write_text(str(1 << 29))
    assert memory_limit.available() == (3 << 29, 2 << 30)   # its own, tighter
    v1 = tmp_path / "memory" / "batch"
    v1.mkdir(parents=True)
    own.write_text("4:memory:/batch\n0::/\n")
    (v1 / "memory.limit_in_bytes").write_text(str(8 << 30))
    (v1 / "memory.usage_in_bytes").write_text(str(7 << 30))
    assert memory_limit.available() == (1 << 30, 8 << 30)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712")   # v1's "no limit"
    assert memory_limit.available() == (20 << 30, 24 << 30)


def test_this_machines_memory_is_read():
    free, total = memory_limit.available()
    assert 0 < free <= total and memory_limit.resident() > 0


def test_a_block_past_its_budget_is_stopped_saying_what_it_took_and_what_to_lower(monkeypatch):
    monkeypatch.setenv(memory_limit.ENV, "64m")
    kept = []
    with pytest.raises(time_limit.MemoryOverrun) as caught:
        with time_limit.bounded("ModelDef toy: reading its first batch"):
            for _ in range(96):   # 768 MiB, were it not stopped
                kept.append(np.ones(CHUNK, np.uint8))
    said = str(caught.value)
    assert said.startswith("ModelDef toy: reading its first batch took more than the 0.1 GiB of memory it may take "
                           f"({memory_limit.ENV}=64m): ")
    assert f"when it was stopped at {__file__}:" in said and "is a size in it (batch_size" in said
    # stopped past the budget, before the end: the chunk being made when it was stopped counts (a CI run
    # on a busy machine was stopped with 8 chunks kept, the 9th made and not yet appended)
    assert 64 << 20 < (len(kept) + 1) * CHUNK and len(kept) < 96
    kept.clear()


def test_a_block_under_its_budget_and_a_workers_block_are_not_stopped(monkeypatch):
    monkeypatch.setenv(memory_limit.ENV, "32m")
    with time_limit.bounded("ModelDef toy: small"):
        small = np.ones(4 << 20, np.uint8)
    with time_limit.bounded("ModelDef toy: a worker's load", in_worker=True):   # Ray watches workers
        large = [np.ones(CHUNK, np.uint8) for _ in range(16)]
    assert small.sum() == 4 << 20 and len(large) == 16


def test_the_command_line_ends_a_block_that_does_not_give_control_back(tmp_path):
    code = textwrap.dedent("""
        import time

        import numpy as np
        from autosync import time_limit

        kept = []
        with time_limit.exit_when_stuck("inspect"), time_limit.bounded("ModelDef m: building the model"):
            for _ in range(96):   # 768 MiB at most: the test fails, nothing hangs
                try:
                    kept.append(np.ones(8 << 20, np.uint8))
                except BaseException:
                    pass
            for _ in range(60):   # then no word back for a minute, as a C call that never returns
                try:
                    time.sleep(1)
                except BaseException:
                    pass
    """)
    env = dict(os.environ, **{memory_limit.ENV: "64m"})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("autosync inspect: error: ModelDef m: building the model took more than the 0.1 GiB "
                                 f"of memory it may take ({memory_limit.ENV}=64m): ")
    assert out.stderr.rstrip().endswith("(the process was ended before the machine ran out)")


def test_a_model_out_of_memory_is_said_as_too_large_a_size():
    from autosync.models.ingest import user_code

    class Def:
        name, batch_size = "toy", 99999999

    with pytest.raises(ConfigError, match=r"^ModelDef toy: reading its first batch failed: MemoryError: Unable to "
                                          r".*; it needs more memory than this process could have: is a size in it "
                                          r"\(batch_size 99999999, the data, a layer\) larger than meant\?$"):
        with user_code(Def(), "reading its first batch"):
            raise MemoryError("Unable to allocate 3.64 TiB for an array")
