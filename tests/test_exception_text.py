"""What a user's model code raised, on one readable line: TensorFlow's traced-function errors
said only "ValueError: in user code:" in a worker's failure, and a screen of frames elsewhere."""
from __future__ import annotations

from autosync.exception_text import what_failed

# the text of a ValueError from a tf.function whose model has a layer name TensorFlow refuses
TRACED = ('in user code:\n\n    File "/x/autosync/models/profile.py", line 67, in step  *\n'
          '        value = loss(targets, model(inputs, training=True))\n'
          '    File "/x/keras/src/utils/traceback_utils.py", line 122, in error_handler  **\n'
          '        raise e.with_traceback(filtered_tb) from None\n\n'
          '    ValueError: Exception encountered when calling Functional.call().\n    \n'
          "    \x1b[1m'emb [users]*' is not a valid scope name. A scope name has to match the following pattern: "
          "^[A-Za-z0-9_.\\\\/>-]*$\x1b[0m\n    \n    Arguments received by Functional.call():\n"
          "      \u2022 inputs=('tf.Tensor(shape=(32,), dtype=int32)',)\n      \u2022 training=True\n")


def test_a_traced_error_keeps_what_is_wrong_and_drops_frames_arguments_and_escapes():
    text = what_failed(ValueError(TRACED))
    assert text == ("ValueError: Exception encountered when calling Functional.call(). 'emb [users]*' is not a valid "
                    "scope name. A scope name has to match the following pattern: ^[A-Za-z0-9_.\\\\/>-]*$")


def test_plain_errors_stay_as_they_are_and_long_ones_are_cut():
    assert what_failed(RuntimeError("boom in a worker")) == "RuntimeError: boom in a worker"
    assert what_failed(KeyError()) == "KeyError"
    assert what_failed(ValueError("first line\n  second line")) == "ValueError: first line second line"
    long = what_failed(ValueError("x" * 1000), limit=50)
    assert len(long) == 54 and long.endswith(" ...") and long.startswith("ValueError: xxx")
