"""What a user's model code raised, on one readable line: TensorFlow's traced-function errors
said only "ValueError: in user code:" in a worker's failure, and a screen of frames elsewhere."""
from __future__ import annotations

from autosync.exception_text import out_of_memory, what_failed

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


# Ray 2.60's text when its memory monitor kills a process (shortened: 16 object store lines, ten processes)
KILLED_FOR_MEMORY = """1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 10.0.0.7, \
ID: 2fd74bee36c0f804bcddc4d7b327b41ebd54801c64d9d736f024e12b) was 22.82GB used / 23.54GB limit (0.969529)
OOM kill reason: Memory usage 24321724416B exceeded threshold of 24012392448B (95.0% of 25276203008B limit)
Object store memory usage: [- objects spillable: 0
- bytes spillable: 0]
Ray killed 1 worker(s) based on the killing policy
Considered workers: [
Selected to kill: (Actor(7833105268165e6db77a9bcb01000000): job ID=01000000, lease ID=00000000277db342602158b6, \
task name=ParameterServerShard.__init__, required resources={}, pid=8072, actual memory used=21.75GB, worker ID=d017)
]
Top 10 memory users: PID\tMEM(GB)\tCOMMAND
8072\t21.75\tray::ParameterServerShard.apply
Refer to the documentation on how to address the out of memory issue: https://docs.ray.io/en/latest/ray-observability/\
user-guides/debug-apps/debug-memory.html. Consider provisioning more memory on this node or reducing task parallelism"""


def test_a_kill_for_memory_is_one_sentence_with_the_nodes_use_and_what_to_change():
    assert out_of_memory(KILLED_FOR_MEMORY) == (
        "Ray killed it for memory: the node at 10.0.0.7 had 22.82GB used / 23.54GB limit, 21.75GB of it in the "
        "process killed. What the strategy keeps on that node (its workers' model copies, parameter-server shards "
        "with their optimizer slots) does not fit there: spread the shards over more nodes, run fewer workers "
        "there, or use a node with more memory")
    assert out_of_memory("1 worker(s) were killed due to the node running low on memory.").startswith(
        "Ray killed it for memory: its node ran low on memory. What")
    assert out_of_memory("RuntimeError: boom") is None


def test_actors_that_never_ran_under_a_token_say_to_unset_it_and_leave_the_model_alone(monkeypatch):
    """Found on the testbed: a driver with RAY_AUTH_MODE=token (what a failed connect's hint says to
    set) connects to a cluster without token auth, and every actor is cancelled; the load failure
    said "check that the model trains on this cluster"."""
    from types import SimpleNamespace

    from autosync.runtime.runner import load_failure
    from strategy_space import ClusterSpec, NodeSpec

    never = RuntimeError("worker node0:0 failed: The actor never ran - it was cancelled before it started running.")
    where = (SimpleNamespace(name="ncf"), ClusterSpec("ray", (NodeSpec("node0"),)))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    said = str(load_failure(*where, never))
    assert "RAY_AUTH_MODE=token is set here" in said and "unset RAY_AUTH_MODE" in said and "autosync run" not in said
    monkeypatch.delenv("RAY_AUTH_MODE")
    said = str(load_failure(*where, never))
    assert "RAY_AUTH_MODE" not in said and said.endswith("check that the model trains on this cluster (autosync run)")


def test_a_python_branch_on_a_tensor_in_a_worker_says_how_to_write_it():
    from types import SimpleNamespace

    from autosync.exception_text import python_branch
    from autosync.runtime.runner import load_failure
    from strategy_space import ClusterSpec, NodeSpec

    assert python_branch("ValueError: bad shape") == ""
    where = (SimpleNamespace(name="m"), ClusterSpec("local", (NodeSpec("node0"),)))
    said = str(load_failure(*where, RuntimeError("worker node0:0 failed: OperatorNotAllowedInGraphError: Using a "
                                                 "symbolic `tf.Tensor` as a Python `bool` is not allowed.")))
    assert said.endswith(python_branch("OperatorNotAllowedInGraphError")) and "keras.ops.cond" in said
    assert "autosync run" not in said
