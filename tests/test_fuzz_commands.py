"""Issue 28: a fuzz suite over every public command, every flag of ``autosync --help`` and every
loader (strategy, model spec, cluster, constraints, trial store, model script).

A seeded generator (deterministic; ``FUZZ_SEED`` and ``FUZZ_CASES`` explore further) builds
command lines from the parser itself: each command's flags, present or not, with values drawn by
what the flag takes (paths: valid, missing, a folder, under a file, odd names; numbers: huge,
negative, NaN, inf, not numbers; names: valid or not) and files generated for the loaders
(mutated valid files, random bytes, deep nesting, alias bombs, huge integers, NaN/inf, wrong
types, damaged trial-store rows, model scripts that raise, exit or return the wrong thing).

Every case must end with exit code 0 or 2; exit 2 with one error message and no traceback,
within ``ALARM_S`` seconds, leaving every file as it was. A case that is not refused but does the
command's real work (a plan of a valid spec fits its predictors: 6-7 s here when idle, over 10 s
beside the integration suite on a slow day) is bounded by ``HANG_S``, which catches a hang. Commands that run Ray or TensorFlow
are fuzzed up to the point where they would start them: the functions that start Ray or build a
model are replaced by a stop (and in this unmarked test importing either raises, see conftest),
counted as "reached the runtime" — valid input so far, so the command went on. ``testbed`` changes this machine's network namespaces: its
command lines always carry an unknown flag, so only its argument parsing is fuzzed.

The numbers (cases, outcomes, time per case, peak memory per loader) are printed with ``-s``
and checked against the limits below.
"""
from __future__ import annotations

import argparse
import functools
import os
import random
import resource
import shutil
import signal
import sqlite3
import time
import tracemalloc
from collections import Counter, defaultdict
from contextlib import contextmanager

import pytest

import autosync.api
import autosync.cli
from autosync.cli import build_parser, main
from strategy_space import ConfigError, load, save
from strategy_space.builders import get_builder
from tests.fakes import three_node_cluster, tiny_model

CASES = int(os.environ.get("FUZZ_CASES", 2000))
SEED = int(os.environ.get("FUZZ_SEED", 28))
LOADER_CASES = int(os.environ.get("FUZZ_LOADER_CASES", 600))
ALARM_S = 10            # no refusal may take longer (the bound for each refusal), nor reaching the runtime
HANG_S = 60             # nor any case (one that does the command's work) this
RSS_GROWTH_MB = 500     # nor grow the process by more than this, all cases together
MEM_PER_BYTE = 40       # the stated bound on loading memory per input byte (strategy_space._yaml_limits)

HUGE_INTS = ["2147483648", "9223372036854775808", "1" + "0" * 40, "-2147483649", "1e12", "1" + "0" * 5000]
SPECIALS = [".nan", ".inf", "-.inf", "nan", "inf", "1e309", "-0", "0x1F", "0o17", "1_000", "~", "null", "true", "''"]
GARBAGE = ["", " ", "-", "--", "x", "zoo:", "zoo:nope", "::", "a:b", "\x7f", "é", "名字", "a" * 300, "../..", "/",
           "$(true)", "%s%n", "{}", "[]", "-1", "0", "nan", "inf", "1e999"]


# ---- the workspace: valid files of every kind, restored after each case that may write ----

SCRIPT_OK = '''
from autosync.model_def import ModelDef


def build():
    return ModelDef(name="fuzz", model_fn=lambda: None, loss_fn=lambda: None, optimizer_fn=lambda: None,
                    dataset_fn=lambda w, n: iter(()), batch_size=8)
'''


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A folder of valid inputs: model, cluster, strategy, constraints YAML, a trial store with
    one tuning run, a model script."""
    from tuner.search.model_based import SearchSettings
    from tuner.synthetic.runner import SyntheticRunner

    d = tmp_path_factory.mktemp("pristine")
    model, cluster = tiny_model(profile=True), three_node_cluster()
    save(model, d / "model.yaml")
    save(cluster, d / "cluster.yaml")
    save(get_builder("ps").build(model, cluster), d / "strategy.yaml")
    (d / "constraints.yaml").write_text("kind: constraints\nstaleness: 0\nvariables:\n"
                                        "- {match: 'dense*', sync: all_reduce, compressor: fp16}\n"
                                        "- {match: 'embedding*', sync: ps, shards: 2}\n")
    (d / "script.py").write_text(SCRIPT_OK)
    autosync.api.tune("unused", cluster, trials=1, store=d / "store.db", warm_start="none",
                      runner=SyntheticRunner(model, cluster),
                      settings=SearchSettings(batch=2, candidates=16, chains=4, anneal_steps=2))
    (d / "a_dir").mkdir()
    (d / "a_file").write_text("not a folder\n")
    return d


def _snapshot(root) -> dict:
    """Every path under ``root`` with its size and modification time (a write changes one)."""
    out = {}
    stack = [str(root)]
    while stack:
        for entry in os.scandir(stack.pop()):
            if entry.is_dir(follow_symlinks=False):   # (a folder's own time moves with a probe file made and removed)
                out[entry.path] = "dir"
                stack.append(entry.path)
            else:
                st = entry.stat(follow_symlinks=False)
                out[entry.path] = (st.st_size, st.st_mtime_ns)
    return out


def _restore(work, pristine) -> None:
    """``work`` (the current directory: kept) holding exactly ``pristine``'s files again."""
    for name in os.listdir(work):
        p = work / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    shutil.copytree(pristine, work, dirs_exist_ok=True)


# ---- generated file contents ----

class Files:
    """Generated bad (and sometimes good) contents for each loader, from one seeded Random."""

    def __init__(self, rng: random.Random, pristine):
        self.rng = rng
        self.valid = {kind: (pristine / f"{kind}.yaml").read_text()
                      for kind in ("model", "cluster", "strategy", "constraints")}
        self.store = (pristine / "store.db").read_bytes()

    def yaml(self, kind: str) -> str:
        r = self.rng
        how = r.choice(["mutate", "mutate", "mutate", "number", "number", "doc", "deep", "bomb", "bytes", "empty",
                        "other-kind", "wide"])
        text = self.valid[kind]
        if how == "mutate":
            lines = text.splitlines()
            for _ in range(r.randint(1, 3)):
                i = r.randrange(len(lines))
                op = r.choice(["delete", "dup", "cut", "char", "indent"])
                if op == "delete" and len(lines) > 1:
                    del lines[i]
                elif op == "dup":
                    lines.insert(i, lines[i])
                elif op == "cut":
                    lines[i] = lines[i][: r.randrange(len(lines[i]) + 1)]
                elif op == "indent":
                    lines[i] = r.choice(["  ", "\t", " "]) + lines[i]
                elif lines[i]:
                    j = r.randrange(len(lines[i]))
                    lines[i] = lines[i][:j] + r.choice(":-[]{}&*!|>'\"#%@`,?") + lines[i][j + 1:]
            return "\n".join(lines) + "\n"
        if how == "number":   # a number replaced by a huge, special or wrong-typed value
            import re

            numbers = list(re.finditer(r"(?<![\w.])\d+(\.\d+)?(?![\w.])", text))
            if numbers:
                m = r.choice(numbers)
                value = r.choice(HUGE_INTS + SPECIALS + ["[1, 2]", "{a: 1}", "abc", "-5", "0", "3.5"])
                return text[:m.start()] + value + text[m.end():]
            return text
        if how == "doc":
            return self._doc(kind)
        if how == "deep":
            n = r.choice([10, 63, 65, 200, 5000])
            return f"kind: {kind}\nvariables: " + "[" * n + "]" * n + "\n"
        if how == "bomb":
            levels = r.randint(3, 12)
            lines = ["- &a0 [x, x, x, x, x, x, x, x]"]
            lines += [f"- &a{i} [" + ", ".join([f"*a{i - 1}"] * 8) + "]" for i in range(1, levels)]
            return f"kind: {kind}\nname: n\nvariables:\n" + "\n".join(lines) + "\n"
        if how == "bytes":
            return bytes(r.randrange(256) for _ in range(r.randint(1, 300))).decode("latin-1")
        if how == "empty":
            return r.choice(["", "\n", "---\n", "--- \n...\n---\n", "# only a comment\n", "null\n", "[]\n", "42\n"])
        if how == "other-kind":
            return self.valid[r.choice(["model", "cluster", "strategy", "constraints"])]
        # wide: many entries (a few hundred KB at most; the 2 MiB cap is tested by the limit tests)
        line = r.choice(["- {a: 1}\n", "- 1\n", "- {var: x, ps: {destination: h0}}\n", "- [1, 2, 3]\n"])
        return f"kind: {kind}\nversion: 1\nname: w\nvariables:\n" + line * r.randint(100, 3000)

    def _doc(self, kind: str) -> str:
        r = self.rng
        keys = ["kind", "version", "name", "variables", "var", "shape", "dtype", "sparse", "rows_per_step",
                "batch_size", "profile", "nodes", "address", "cpus", "gpus", "workers", "bandwidth_gbps", "chief",
                "partition", "shards", "axis", "ps", "all_reduce", "destination", "sync", "staleness", "compressor",
                "group", "backend", "replicas", "match", "local_replication", "hierarchical", "origin"]

        def value(depth):
            roll = r.random()
            if depth > 3 or roll < 0.5:
                return r.choice(HUGE_INTS + SPECIALS + ["h0", "ps", "fp16", "powersgd(99999)", "powersgd(0)", "nccl",
                                                       "1", "0", "-1", "2.5", "float32", "int64", "x", "'*'"])
            if roll < 0.75:
                return "[" + ", ".join(value(depth + 1) for _ in range(r.randint(0, 4))) + "]"
            return "{" + ", ".join(f"{r.choice(keys)}: {value(depth + 1)}" for _ in range(r.randint(0, 5))) + "}"

        body = "\n".join(f"{r.choice(keys)}: {value(0)}" for _ in range(r.randint(1, 6)))
        return f"kind: {kind}\n" + body + "\n" if r.random() < 0.7 else body + "\n"

    def store_bytes(self) -> bytes:
        r = self.rng
        data = bytearray(self.store)
        how = r.choice(["flip", "truncate", "zero-page", "header", "random"])
        if how == "flip":
            for _ in range(r.randint(1, 20)):
                data[r.randrange(len(data))] = r.randrange(256)
        elif how == "truncate":
            data = data[: r.randrange(len(data))]
        elif how == "zero-page":
            start = r.randrange(0, len(data), 4096)
            data[start:start + 4096] = bytes(min(4096, len(data) - start))
        elif how == "header":
            data[r.randrange(100)] = r.randrange(256)
        else:
            data = bytearray(r.randbytes(r.randint(0, 5000)))
        return bytes(data)

    def damage_rows(self, path) -> None:
        """One or more cells of a valid store replaced by garbage (bad JSON, wrong types, NULL)."""
        r = self.rng
        with sqlite3.connect(path) as db:
            ids = [i for (i,) in db.execute("SELECT id FROM trials")]
            for _ in range(r.randint(1, 3)):
                table, column = r.choice([("trials", "step_times"), ("trials", "breakdown"), ("trials", "meta"),
                                          ("trials", "status"), ("trials", "batch_size"), ("trials", "median_s"),
                                          ("trials", "strategy_fp"), ("trials", "model_fp"), ("trials", "origin"),
                                          ("strategies", "yaml"), ("models", "spec_yaml"), ("clusters", "spec_yaml")])
                value = r.choice(["{bad", "[1, 2", "null", None, 5, -1.5, "[\"x\"]", "{}", "[]", "kind: strategy\n",
                                  "x" * 1000, "\x00", 2**62, "NaN", "[1e999]"])
                try:   # a value the schema refuses (NOT NULL) is not a damage SQLite lets happen
                    if table == "trials" and ids:
                        db.execute(f"UPDATE trials SET {column} = ? WHERE id = ?", (value, r.choice(ids)))
                    else:
                        db.execute(f"UPDATE {table} SET {column} = ?", (value,))
                except sqlite3.IntegrityError:
                    pass
        db.close()

    def script(self) -> str:
        r = self.rng
        return r.choice([
            "def build(:\n",
            "raise RuntimeError('at import')\n",
            "import sys\nsys.exit(%d)\n" % r.choice([0, 1, 3, 255]),
            "import sys\ndef build():\n    sys.exit('bye')\n",
            "def build():\n    raise ValueError('in the function')\n",
            "def build():\n    return 42\n",
            "build = 3\n",
            "def other():\n    pass\n",
            "def build(a, b):\n    pass\n",
            "def build():\n    return build()\n",
            "import no_such_module_anywhere\n",
            "\x00\xff",
            "x = 1\n" * r.randint(1, 2000),
            "class E(BaseException):\n    pass\nraise E()\n",
            "def build():\n    raise KeyboardInterrupt\n" if False else "def build():\n    raise MemoryError\n",
            SCRIPT_OK.replace("batch_size=8", r.choice(["batch_size=0", "batch_size=-1", "batch_size='8'",
                                                          "batch_size=2**40"])),
            SCRIPT_OK.replace('name="fuzz"', r.choice(['name=""', "name=None", 'name="a" * 10000'])),
            SCRIPT_OK,
        ])


# ---- generated command lines, from the parser ----

def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


class Argv:
    """Command lines for one command, its flags drawn from its parser."""

    def __init__(self, rng: random.Random, files: Files, work):
        self.rng, self.files, self.work = rng, files, work
        self.n = 0

    def _fuzz_file(self, kind: str, suffix: str = ".yaml") -> str:
        """A new file of generated content for loader ``kind``; its path."""
        self.n += 1
        path = self.work / f"fuzz{self.n}{suffix}"
        if kind == "store":
            if self.rng.random() < 0.5:
                path.write_bytes(self.files.store)
                self.files.damage_rows(path)
            else:
                path.write_bytes(self.files.store_bytes())
        elif kind == "script":
            path.write_text(self.files.script(), encoding="latin-1")
        else:
            path.write_text(self.files.yaml(kind), encoding="utf-8", errors="surrogatepass")
        return str(path)

    def _odd_path(self, writes: str | None) -> str:
        r, w = self.rng, self.work
        return r.choice([
            str(w / "missing.yaml"), str(w / "a_dir"), str(w / "a_file" / "x.yaml"), str(w / "a_file"),
            str(w / ("n" * 300 + ".yaml")), str(w / "new\nline.yaml"), str(w / " lead.yaml"), str(w / "ü.yaml"),
            "/dev/null", "/proc/self/status", "/proc/new.yaml", "/sys/kernel/notes", "/", "", "-",
            str(w / "sub" / "deeper" / "x.yaml"),
            str(w / "out.yaml"), str(w / "report"), str(w / "x.db"), "relative/x.yaml", "x.yaml",
        ])

    def value(self, cmd: str, flag: str, action) -> str:
        r, w = self.rng, self.work
        odd = r.random() < 0.25
        if action.choices:
            return r.choice(list(action.choices)) if r.random() < 0.8 else r.choice(GARBAGE)
        if action.type is int:
            return r.choice(["1", "2", "3", "0", "-1", "100", "1000000"] + HUGE_INTS[:4] + ["x", "1.5", "", "nan"])
        if action.type is float:
            return r.choice(["0.01", "0.1", "1", "0", "-1", "nan", "inf", "-inf", "1e308", "1e-308", "x", "", "5"])
        f = self._fuzz_file
        if flag == "--model":
            pick = r.choice([lambda: str(w / "model.yaml"), lambda: "zoo:ncf", lambda: "zoo:nope",
                             lambda: f"{w}/script.py:build", lambda: f"{w}/script.py:nope",
                             lambda: f"{w}/missing.py:build", lambda: f"{f('script', '.py')}:build",
                             lambda: f("model"), lambda: f("model"), lambda: self._odd_path(None),
                             lambda: r.choice(GARBAGE)])
            return pick()
        if flag == "--cluster":
            pick = r.choice([lambda: "local", lambda: "testbed", lambda: str(w / "cluster.yaml"), lambda: f("cluster"),
                             lambda: f("cluster"), lambda: self._odd_path(None), lambda: r.choice(GARBAGE)])
            return pick()
        if flag in ("--strategy", "file"):
            pick = r.choice([lambda: str(w / "strategy.yaml"), lambda: f("strategy"), lambda: f("strategy"),
                             lambda: f("strategy"), lambda: self._odd_path(None), lambda: r.choice(GARBAGE)])
            return pick()
        if flag == "--constraints":
            pick = r.choice([lambda: str(w / "constraints.yaml"), lambda: f("constraints"), lambda: f("constraints"),
                             lambda: self._odd_path(None), lambda: r.choice(GARBAGE)])
            return pick()
        if flag in ("--eval", "--warm-start", "--store"):
            # a valid store makes report draw its plots and simulate --eval fit its predictors
            # (~1-2 s each): a few cases suffice for those paths
            if r.random() < (0.01 if cmd in ("report", "simulate") else 0.2):
                return str(w / "store.db")
            pick = r.choice([lambda: f("store", ".db"), lambda: f("store", ".db"), lambda: self._odd_path(None),
                             lambda: str(w / "model.yaml")]
                            + ([lambda: "none", lambda: "builtin", lambda: r.choice(GARBAGE)] if flag == "--warm-start"
                               else [lambda: str(w / "new.db")] if cmd == "tune" else []))
            return pick()
        if flag in ("--out", "--report"):
            return self._odd_path("out") if odd or r.random() < 0.6 else str(w / "out" / "x.yaml")
        if flag == "--builder":
            from strategy_space.builders import BUILDERS

            return r.choice(sorted(BUILDERS)) if r.random() < 0.8 else r.choice(GARBAGE)
        if flag == "--option":
            key = r.choice(["chunk_bytes", "min_partition_bytes", "compressor", "backend", "group", "nope", ""])
            return f"{key}={r.choice(['1', '0', '-1', 'fp16', 'powersgd(99999)', 'nccl', 'x', '', '1e99', 'nan'])}"
        if flag == "--optimizer":
            return r.choice(["sgd", "adam", "momentum", "rmsprop", "x", ""])
        if flag == "--backend":
            return r.choice(["auto", "gloo", "objectstore", "nccl", "mpi", ""])
        if flag == "--run":
            return r.choice(["", "x", "0", "nope", "%"])
        return r.choice(GARBAGE)

    def argv(self, cmd: str, parser: argparse.ArgumentParser) -> list[str]:
        r = self.rng
        out = [cmd]
        if cmd == "testbed":   # parsing only: an unknown flag makes argparse refuse every line
            sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            # (not exec: it passes everything after it, an unknown flag too, to the command it runs)
            return out + ["--fuzz-unknown-flag", r.choice([c for c in sub.choices if c != "exec"] + ["nope"]),
                          r.choice(GARBAGE)]
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                if r.random() < 0.01:
                    out.append("--help")
                continue
            flag = action.option_strings[0] if action.option_strings else action.dest
            if not (action.required or not action.option_strings) and r.random() < 0.5:
                continue
            if action.required and r.random() < 0.03:
                continue   # a missing required flag
            if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                out.append(flag)
                continue
            if action.option_strings:
                out.append(flag)
            out.append(self.value(cmd, flag, action))
        if cmd == "tune" and "--warm-start" not in out:
            out += ["--warm-start", "none"]   # the builtin dataset is loaded by a few cases only (0.6 s each)
        if r.random() < 0.03:
            out.append(r.choice(["--nope", "extra", "--json=1", "-x"]))
        return out


# ---- running one case ----

class ReachedRuntime(Exception):
    """The command would start Ray or TensorFlow now (its input was valid so far)."""


@contextmanager
def _bounded(seconds: float):
    def fail(*_):
        raise AssertionError(f"a case took longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _run(argv: list[str]) -> str | int:
    """Exit code of ``main(argv)``, or "runtime" when it went on to start Ray or TensorFlow."""
    try:
        return main(argv)
    except SystemExit as e:   # argparse: 2 for a bad command line, 0 for --help
        return e.code if isinstance(e.code, int) else 2
    except ReachedRuntime:
        return "runtime"
    except ImportError as e:   # (the conftest guard, where a module is not loaded yet)
        if "is not marked @pytest.mark.integration" in str(e):
            return "runtime"
        raise


def _check_error(cmd: str, err: str) -> None:
    assert "Traceback" not in err, err[-3000:]
    while err.startswith(f"autosync {cmd}: warning: "):   # a warning (inspect's on an optimizer) may come first
        err = err.split("\n", 1)[1] if "\n" in err else ""
    assert err.count(": error: ") == 1, err[-3000:]
    lines = err.rstrip("\n").splitlines()
    if err.startswith("usage: "):   # argparse's own refusal: usage lines, then one error line
        assert lines[-1].startswith("autosync") and ": error: " in lines[-1], err
    else:   # ours: one message (a multi-problem one lists its problems under it)
        assert err.startswith(f"autosync {cmd}: error: "), err[-3000:]
        assert "\n\n" not in err.strip() and len(err) < 20_000, err[-3000:]


@pytest.fixture
def fuzz_env(pristine, tmp_path, monkeypatch):
    work = tmp_path / "work"
    shutil.copytree(pristine, work)
    monkeypatch.chdir(work)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))   # tune's default store, never the user's
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    # where the commands would start Ray or build a model with TensorFlow: stop there (the import
    # guard alone does not, when an integration test loaded Ray or TensorFlow in this process)
    import autosync.calibrate
    import autosync.cli.runtime
    import autosync.models.ingest
    import autosync.models.profile
    import autosync.runtime.rows

    def stop(*a, **k):
        raise ReachedRuntime()

    for module, name in ((autosync.api, "make_runner"), (autosync.cli.runtime, "_runner"),
                         (autosync.calibrate, "calibrate"), (autosync.models.ingest, "built_model_spec"),
                         (autosync.models.profile, "profiled_model_spec"), (autosync.runtime.rows, "row_reads_of")):
        monkeypatch.setattr(module, name, stop)
    # one parser for every case (building it takes ~10 ms) and the builtin warm start read once
    monkeypatch.setattr(autosync.cli, "build_parser", functools.lru_cache(maxsize=1)(build_parser))
    from tuner.records.warmstart import load_warm_start

    cached = functools.lru_cache(maxsize=4)(lambda source: tuple(load_warm_start(source)))
    monkeypatch.setattr(autosync.api, "load_warm_start",
                        lambda source: list(cached(source)) if isinstance(source, str) else load_warm_start(source))
    return work


def test_every_command_and_flag_answers_exit_0_or_2_with_one_message(fuzz_env, pristine, tmp_path, capsys):
    work = fuzz_env
    rng = random.Random(SEED)
    files = Files(rng, pristine)
    gen = Argv(rng, files, work)
    commands = _commands()
    # the commands that read user files get more cases; builders/models read nothing; a report
    # that passes its checks draws plots (~1.5 s): fewer report cases keep the suite in its time
    weights = {name: 1 for name in commands} | {"builders": 0.2, "models": 0.3, "testbed": 0.3, "report": 0.5,
                                                 "simulate": 0.7}
    names = sorted(commands)
    outcomes: Counter = Counter()
    per_command: dict[str, list[float]] = defaultdict(list)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.monotonic()
    for case in range(CASES):
        cmd = rng.choices(names, weights=[weights[n] for n in names])[0]
        argv = gen.argv(cmd, commands[cmd])
        if cmd == "models" and "--no-build" not in argv:
            argv.append("--no-build")   # building the zoo is TensorFlow: counted below as the runtime anyway
        before = _snapshot(work)
        t = time.monotonic()
        with _bounded(HANG_S):
            code = _run(argv)
        took = time.monotonic() - t
        per_command[cmd].append(took)
        out, err = capsys.readouterr()
        outcomes[code] += 1
        assert code in (0, 2, "runtime"), (case, argv, code, err[-3000:])
        assert code == 0 or took <= ALARM_S, (case, argv, code, f"took {took:.1f} s")
        assert "Traceback" not in out + err, (case, argv, err[-3000:])
        after = _snapshot(work)
        if code == 2:
            _check_error(cmd, err)
            assert after == before, (case, argv, "a refused command changed files")
        if after != before or gen.n > 200:
            _restore(work, pristine)
            gen.n = 0
    elapsed = time.monotonic() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0
    times = sorted(x for v in per_command.values() for x in v)
    print(f"\ncommand fuzz: {CASES} cases in {elapsed:.1f} s ({1e3 * elapsed / CASES:.1f} ms a case, median "
          f"{1e3 * times[len(times) // 2]:.1f} ms, slowest {times[-1]:.2f} s); outcomes {dict(outcomes)}; peak RSS "
          f"grew {grown:.0f} MiB")
    for cmd in names:
        v = per_command[cmd]
        if v:
            print(f"  {cmd:10s} {len(v):5d} cases  mean {1e3 * sum(v) / len(v):7.1f} ms  max {max(v):6.2f} s")
    assert outcomes[2] > CASES // 2   # most generated lines are refused (the point of the generator)
    assert grown < RSS_GROWTH_MB


# ---- the loaders fed directly: every answer a value or one ConfigError, memory measured ----

def _loaders(pristine):
    from autosync.sources import load_model_def
    from tuner.search.constraints import load_constraints
    from tuner.records.store import open_existing_store

    def store(path):
        with open_existing_store(path) as s:
            return s.trials()

    return {
        "strategy": lambda p: load(p, "strategy"),
        "model": lambda p: load(p, "model"),
        "cluster": lambda p: load(p, "cluster"),
        "constraints": lambda p: load_constraints(str(p)),
        "store": store,
        "script": lambda p: load_model_def(f"{p}:build"),
    }


def test_every_loader_answers_with_a_value_or_one_config_error(pristine, tmp_path):
    rng = random.Random(SEED + 1)
    files = Files(rng, pristine)
    gen = Argv(rng, files, tmp_path)
    loaders = _loaders(pristine)
    stats: dict[str, Counter] = defaultdict(Counter)
    largest: dict[str, tuple[int, str]] = {}
    start = time.monotonic()
    for case in range(LOADER_CASES):
        kind = rng.choice(sorted(loaders))
        path = gen._fuzz_file(kind, {"store": ".db", "script": ".py"}.get(kind, ".yaml"))
        size = os.path.getsize(path)
        if size > largest.get(kind, (-1, ""))[0]:
            largest[kind] = (size, path)
        with _bounded(ALARM_S):
            try:
                loaders[kind](path)
                stats[kind]["loaded"] += 1
            except ConfigError as e:
                stats[kind]["refused"] += 1
                assert "Traceback" not in str(e) and len(str(e)) < 20_000, str(e)[:3000]
    elapsed = time.monotonic() - start
    print(f"\nloader fuzz: {LOADER_CASES} cases in {elapsed:.1f} s ({1e3 * elapsed / LOADER_CASES:.1f} ms a case)")
    # peak memory of each loader on the largest input it was given, against the stated bound
    for kind, (size, path) in sorted(largest.items()):
        tracemalloc.start()
        try:
            loaders[kind](path)
        except ConfigError:
            pass
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        print(f"  {kind:11s} {dict(stats[kind])}  largest input {size / 1024:.0f} KiB: peak {peak / 2**20:.1f} MiB")
        if kind not in ("store", "script"):   # YAML: the stated multiple of the file's size (plus fixed costs)
            assert peak < MEM_PER_BYTE * size + 4 * 2**20, (kind, size, peak)
        else:
            assert peak < 64 * 2**20, (kind, size, peak)
