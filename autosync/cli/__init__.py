"""The ``autosync`` command line.

Each command area lives in its own module of this package with a ``register(subparsers)``
function that adds its sub-commands and sets ``func`` (``args -> int exit code``).
Bad input raises ``ConfigError``; it is printed as one message and exits with code 2.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import signal
import sys
import warnings

from autosync import signals, time_limit
from strategy_space.errors import ConfigError

# modules of this package that add sub-commands, in help order
COMMAND_MODULES = (
    "offline",   # builders, build, validate, show
    "models",    # models, inspect
    "testbed",   # up, shape, status, down, exec
    "runtime",   # run, baselines (Ray)
    "train",     # train with a strategy: checkpoints, recovery
    "simulate",  # predicted step time of a strategy; evaluation of the predictors
    "plan",      # the strategies predicted best for a model on a cluster, nothing run
    "calibrate",  # measured collective and PS costs of a cluster, into its spec
    "probe",     # statistical efficiency of a strategy's lossy parts
    "tune",      # tune (the main job), report
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autosync",
        description="Find and run the fastest gradient synchronization strategy for a model on a Ray cluster.",
    )
    from autosync import __version__

    parser.add_argument("--version", action="version", version=f"autosync {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"autosync.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # TensorFlow's C++ start-up chatter (CPU features, a CUDA probe) is noise on the command line;
    # set before anything imports TensorFlow, and inherited by the Ray workers started from here
    # (each of which filters its own import: autosync.tflog). AUTOSYNC_TF_LOGS=1 shows it all.
    from autosync import tflog

    if not tflog.wanted():
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    tflog.driver_startup()   # and TensorFlow's GPU memory taken as needed (see there)
    # Keras' scikit-learn wrappers and matplotlib galleries, which no command uses: 2 s of the import
    from autosync.runtime.lean_import import skip_keras_extras

    skip_keras_extras()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unrecognized(parser, args, extra)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        with signals.terminate_as_interrupt(), time_limit.exit_when_stuck(args.command), \
                time_limit.allowing(getattr(args, "timeout", None)), _warnings(args.command):
            return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"autosync {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader (e.g. `| head`) went away: stop quietly, as Unix tools do
        sys.stdout = open(os.devnull, "w")
        return 0
    except OSError as e:
        if e.errno not in _NO_ROOM:
            raise
        # a full disk or a read-only file system met while writing an output
        print(f"autosync {args.command}: error: cannot write{f' {e.filename}' if e.filename else ''}: "
              f"{e.strerror}; make room (or give another output path) and run the command again", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # Ctrl-C, or SIGTERM stopping it as Ctrl-C does (autosync.signals)
        if signals.terminated():
            _stopped(args, "terminated (SIGTERM)")
            return 128 + signal.SIGTERM
        _stopped(args, "interrupted")
        return 130
    except SystemExit as e:
        # a ray.init the handler was not installed again after turns SIGTERM into sys.exit(15)
        if e.code != signal.SIGTERM:
            raise
        _stopped(args, "terminated (SIGTERM)")
        return 128 + signal.SIGTERM


def _unrecognized(parser: argparse.ArgumentParser, args, extra: list[str]) -> None:
    """Arguments no parser took, said by the command's own parser (its usage, ``autosync CMD:
    error:``, exit code 2) rather than the top level's, with the option meant where one is close
    (``--trails`` -> ``--trials``)."""
    import difflib

    command = parser
    for _ in range(8):   # down to the (sub-)command given, however deep
        sub = next((a for a in command._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(args, sub.dest, None) if sub is not None else None
        if chosen not in (sub.choices if sub is not None else {}):
            break
        command = sub.choices[chosen]
    options = [o for a in command._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for word in extra:
        name = word.split("=", 1)[0]
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.6) if name.startswith("-") else []
        if close:
            hints.append(f"{name}: did you mean {close[0]}?")
    command.error(f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else "")
                  + f"; see {command.prog} --help")


# a write the file system refuses for want of room or of write access to the whole file system
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)

# the packages whose warnings are AutoSync's own
_OWN = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), p, "")
             for p in ("autosync", "strategy_space", "tuner"))


@contextlib.contextmanager
def _warnings(command: str):
    """AutoSync's own warnings (of the user's model, ...) are said as the command's: ``autosync
    CMD: warning: TEXT``, on the terminal even while Ray's output goes to a log (``raylog``),
    where nobody would read them; what the runtime warns of the user's data (``data_check``)
    when the command ends. Other libraries' warnings are shown as Python shows them."""
    from autosync.cli import raylog
    from autosync.runtime.data_check import TrainingWarning

    said: list[str] = []
    shown = warnings.showwarning

    def show(message, category, filename, *args, **kwargs):
        if issubclass(category, TrainingWarning):
            said.append(str(message))
        elif os.path.abspath(str(filename)).startswith(_OWN):
            print(f"autosync {command}: warning: {message}", file=raylog.terminal())
        else:
            shown(message, category, filename, *args, **kwargs)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown
        for text in dict.fromkeys(said):
            print(f"autosync {command}: warning: {text}", file=sys.stderr)


def _stopped(args, how: str) -> None:
    """What a command stopped from outside says; a tune run also says that nothing is lost."""
    resume = ("; the trials measured so far are in its store: the same command with --resume continues the run"
              if args.command == "tune" else "")
    if args.command == "train" and getattr(args, "checkpoint_dir", None):
        resume = (f"; the last checkpoint written is in {args.checkpoint_dir}: --restore {args.checkpoint_dir} "
                  f"continues from it")
    print(f"autosync {args.command}: {how}{resume}", file=sys.stderr)
