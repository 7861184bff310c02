"""TensorFlow's start-up log lines, silenced unless the user asks for them (``AUTOSYNC_TF_LOGS=1``).

Importing TensorFlow prints, on every import in every process, lines such as::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:1795585847.434709   30539 cudart_stub.cc:31] Could not find cuda drivers on your machine, ...

twice (two of its libraries load the same notice). ``TF_CPP_MIN_LOG_LEVEL`` does not reach them:
absl writes everything logged before its ``InitializeLog`` to file descriptor 2, whatever the
level. So ``quiet_startup`` (called before TensorFlow is imported: by the command line's ``main``
and by the Ray worker processes that import it) sets ``TF_CPP_MIN_LOG_LEVEL`` unless the user set
it, and arranges that the first ``import tensorflow`` of the process runs with file descriptor 2
sent to a temporary file; once the import is done, every line of it that is not an absl INFO or
WARNING line or absl's notice is written to the real stderr (errors and Python warnings are
kept). If the import raises, everything it printed is written back, unfiltered (not where it was
stopped from outside: Ctrl-C, or the limits on the user's code, ``time_limit``). TensorFlow's
Python logger is set to ERROR after the import, unless the user configured it.

Nothing happens at import of this module; ``quiet_startup`` reads the environment when called.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import logging
import os
import re
import sys
import tempfile

from autosync.time_limit import Overrun

ENV = "AUTOSYNC_TF_LOGS"

# absl's notice, its INFO and WARNING lines ("I0000 00:00:1795585847.434709   30539 cudart_stub.cc:31] ...")
# and the CPU-feature notice's second line; ERROR (E) and FATAL (F) lines are kept
STARTUP_NOISE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
                           r"STDERR|[IW]\d{4} [\d:.]+\s+\d+ \S+:\d+\] .*|To enable the following instructions:.*)$")


def wanted() -> bool:
    """Whether the user asked to see TensorFlow's start-up logs (``AUTOSYNC_TF_LOGS=1``)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def quiet_startup(modules: tuple[str, ...] = ("tensorflow",)) -> None:
    """Silence TensorFlow's start-up log lines in this process (see the module docstring).

    Call it before TensorFlow is imported; it does nothing when the user asked for the logs, and
    nothing more once TensorFlow is imported or the hook is in place. Child processes inherit
    ``TF_CPP_MIN_LOG_LEVEL``; each Python process that imports TensorFlow calls this itself.

    Args:
        modules: the top-level modules whose first import is filtered (tests use a stand-in).
    """
    if wanted():
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    todo = tuple(m for m in modules if m not in sys.modules)
    if todo and not any(isinstance(f, _QuietImport) and f.modules == todo for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietImport(todo))


def driver_startup() -> None:
    """``quiet_startup``, and TensorFlow told to take GPU memory as it needs it
    (``TF_FORCE_GPU_ALLOW_GROWTH=true`` unless set): for the process that drives a run, the command
    line's or a user's script calling the API. It builds the model only to read its variables, and
    TensorFlow otherwise reserves nearly all the memory of every GPU it sees at its first
    operation, which on a GPU node is the memory that node's workers train in. No effect once
    TensorFlow has set up its GPUs in this process (a script that trained on them first keeps
    its own setting)."""
    quiet_startup()
    os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")


class _QuietImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the first import of each of ``modules`` so that
    the module's top level runs with its start-up noise filtered out of file descriptor 2."""

    def __init__(self, modules: tuple[str, ...]):
        self.modules = modules
        self.pending = set(modules)

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        self.pending.discard(name)
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = None
        for finder in list(sys.meta_path):
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            with filtered_stderr():
                run(module)
            tf_logger = logging.getLogger(name)
            if tf_logger.level == logging.NOTSET:
                tf_logger.setLevel(logging.ERROR)

        # the spec's own loader stays in place (resources, is_package, ...): only this call is wrapped
        spec.loader.exec_module = exec_module
        return spec


@contextlib.contextmanager
def filtered_stderr():
    """Send file descriptor 2 to a temporary file during the block; afterwards write back what is
    not start-up noise (everything, if the block raised). A file, not a pipe: a library that logs
    while holding the GIL can never block on a full pipe nobody reads."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = os.dup(2)
    failed = False
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        except BaseException as e:
            # the import's own failure: everything it printed may say why; a stop from outside it
            # (Ctrl-C, or the time or memory limit on the user's code importing it) is no such thing
            failed = not isinstance(e, (KeyboardInterrupt, Overrun))
            raise
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace")
            kept = text if failed else "".join(
                line for line in text.splitlines(keepends=True) if not STARTUP_NOISE.match(line.rstrip("\r\n")))
            data = kept.encode()
            while data:
                data = data[os.write(2, data):]
