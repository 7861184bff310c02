"""Every function the runtime traces is traced without AutoGraph, as Keras' ``fit`` traces its
step (``autosync/runtime/fast_call.py``): a new ``tf.function`` that forgets it would pay AutoGraph's
conversion (0.3-0.6 s of CPU) again in every worker and PS process. Read from the sources: no
TensorFlow here."""
from __future__ import annotations

import os
import re

from tests.conftest import REPO

# a tf.function call or decorator, with its arguments up to the closing parenthesis of one level
CALL = re.compile(r"tf\.function\b(\((?:[^()]|\([^()]*\))*\))?")


def _uses(text: str) -> list[str]:
    return [m.group(0) for m in CALL.finditer(text)
            if not text[:m.start()].rsplit("\n", 1)[-1].lstrip().startswith("#")
            and not _in_docstring_or_text(text, m.start())]


def _in_docstring_or_text(text: str, at: int) -> bool:
    line = text[:at].rsplit("\n", 1)[-1]
    return line.count("`") % 2 == 1 or line.count('"') % 2 == 1 or not re.search(r"(@|=|\()\s*$|return\s+$", line)


def test_every_tf_function_in_the_package_is_traced_without_autograph():
    found = {}
    for root, _, files in os.walk(os.path.join(REPO, "autosync")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    uses = _uses(f.read())
                if uses:
                    found[os.path.relpath(path, REPO)] = uses
    assert len(found) >= 5, found   # the worker, fast_call, rows, graph, tf_collective, profile
    missing = {p: [u for u in uses if "autograph=False" not in u] for p, uses in found.items()}
    assert not any(missing.values()), missing


def test_the_scan_sees_a_tf_function_that_forgets_it():
    assert _uses("    @tf.function\n    def f(x):\n") == ["tf.function"]
    assert _uses("    g = tf.function(lambda t: t, input_signature=[s])\n") == [
        "tf.function(lambda t: t, input_signature=[s])"]
    assert _uses('    """a ``tf.function`` of the step"""\n') == []
