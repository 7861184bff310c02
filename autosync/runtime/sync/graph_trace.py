"""Profiling the ``graph`` backend's training step: one step under TensorFlow's profiler
(``trace_step``) and what its trace says about overlap of the collectives with the backward pass
(``overlap_from_trace``); used by ``benchmarks/graph_vs_gloo_step.py`` and the tests."""
from __future__ import annotations


def trace_step(worker, logdir: str) -> list[tuple[str, int, int]]:
    """Run one training step of ``worker`` (a TrainingWorker after ``reset``; every worker of the
    group must run it at the same time) under TensorFlow's profiler.

    Returns:
        ``(op name, start ns, end ns)`` of every op executed, as the profiler recorded them.
    """
    import glob
    import os

    import tensorflow as tf

    x, y = next(worker.batches)
    worker._compute(x, y)  # noqa: SLF001 - traced and warm before profiling
    x, y = next(worker.batches)
    tf.profiler.experimental.start(logdir)
    try:
        worker._compute(x, y)  # noqa: SLF001
    finally:
        tf.profiler.experimental.stop()
    try:
        from tsl.profiler.protobuf import xplane_pb2
    except ImportError:  # older layouts
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    path = max(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        names = plane.event_metadata
        for line in plane.lines:
            for e in line.events:
                start = line.timestamp_ns + e.offset_ps // 1000
                events.append((names[e.metadata_id].name, start, start + e.duration_ps // 1000))
    return events


def overlap_from_trace(events: list[tuple[str, int, int]]) -> dict:
    """What one traced step says about overlap.

    Returns:
        ``first_collective_start`` and ``last_gradient_end`` (ns; gradient ops are the ones the
        tape names ``gradient_tape/...``), and ``hidden_share``: the share of the time collectives
        were running that lies before the last gradient op ended (0 when no collective ran).
    """
    collectives = sorted((a, b) for n, a, b in events if "Collective" in n and b > a)
    gradients = [b for n, a, b in events if n.startswith("gradient_tape/")]
    if not collectives or not gradients:
        return {"first_collective_start": None, "last_gradient_end": None, "hidden_share": 0.0}
    last = max(gradients)
    merged: list[list[int]] = []  # union of the collectives' intervals
    for a, b in collectives:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    busy = sum(b - a for a, b in merged)
    hidden = sum(max(0, min(b, last) - a) for a, b in merged)
    return {"first_collective_start": collectives[0][0], "last_gradient_end": last,
            "hidden_share": hidden / busy if busy else 0.0}
