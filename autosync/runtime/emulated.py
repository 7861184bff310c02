"""Emulated compute: a worker that runs no TensorFlow, for measuring synchronization as a GPU
cluster sees it.

On a GPU cluster the forward and backward passes run on the GPUs and leave the CPUs and the NIC
to synchronization; on this machine real TensorFlow compute of every node competes with the
parameter servers and Ray for the same cores. ``EmulatedWorker`` has ``TrainingWorker``'s actor
interface (``load``/``reset``/``run``/``get_weights``/``info``) but each step it

1. draws the step's sparse rows (``rows_per_step`` distinct rows of each sparse variable,
   Zipf-like, deterministic per (seed, worker, step)) -- before pulling, so a pull that names the
   rows a step reads can be given them;
2. pulls the step's values from its channels (real transfers; a parameter server sends only those
   rows of a sparse variable, as it does for a TensorFlow worker);
3. waits the profiled compute time (``profile.step_time_s`` x the cluster's ``compute_dilation``,
   or ``--step-time``) asleep, using no CPU;
4. hands gradients of the ModelSpec's exact names, shapes, dtypes and sparsity to its channels,
   in gradient-ready order. A channel takes one step's gradients at once (``push(step, grads)``),
   when the last one is ready, as the TensorFlow worker does; except the all-reduce groups a
   GPU worker reduces inside its training step (``ARMember.in_step``: backend ``auto`` or
   ``graph``, whose collectives TensorFlow issues in the plan's order, each as soon as its
   gradients are ready, while the backward pass goes on: ``sync.graph``). Those are reduced
   while the compute still runs (``early_collectives``), each when its gradients are ready by
   ``strategy_space.builders.ready_times`` (the cost model's overlap assumption: backward work
   proportional to parameters after a forward third) and its predecessor is done; the rest of
   the step and the update follow as before. A group mixing such members with others waits
   for the hand-over, and a step held for ``global_clipnorm`` overlaps nothing. Beside such
   collectives the parameter servers' push leaves when its own gradients are ready, from a thread
   (``sync.early_push``), as a TensorFlow worker's leaves from inside its step.

Gradient values are synthetic and cheap: each worker draws a fixed dense gradient per variable
and a fixed block of row values per sparse variable at ``load`` (from (seed, worker, variable));
only the sparse row indices change per step. ``synthetic_gradients`` gives the exact gradients of
any (worker, step), so tests can replay training in numpy. Variables that are not floats get no
gradient (as in TensorFlow). Initial values are zeros, described (``ZeroInitial``), never allocated:
a worker holds only what it sends (each dense variable's gradient, each sparse one's block of
rows) and the whole values it pulls.

Parameter servers, collectives, compression and optimizer updates are the real ones. The
optimizer is chosen by name (``OPTIMIZERS``; default ``sgd``), since a ModelSpec names none; a
spec whose model clips by the global norm (``ModelSpec.global_clipnorm``) gets it with
``global_clipnorm`` = ``CLIPNORM``, and its steps are held as a TensorFlow worker's are
(``sync.base``): the parameter servers wait for the norm's parts and the scale.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from autosync.runtime import timeline
from autosync.runtime.digest import zeros_digest
from autosync.runtime.initial import ZeroInitial
from autosync.runtime.sync.base import hand_over
from autosync.runtime.sync.early_push import EarlyPush, early_channels
from strategy_space import ClusterSpec, ModelSpec
from strategy_space.builders import ready_order, ready_times
from strategy_space.errors import ConfigError

# name -> Keras optimizer config the numpy optimizers on parameter servers and all-reduce apply
OPTIMIZERS = {
    "sgd": {"class": "SGD", "learning_rate": 0.01},
    "momentum": {"class": "SGD", "learning_rate": 0.01, "momentum": 0.9},
    "adam": {"class": "Adam", "learning_rate": 0.001},
    "adagrad": {"class": "Adagrad", "learning_rate": 0.01},
}
# the emulated ``global_clipnorm`` (a spec says only whether its model clips): below the norm of the
# synthetic gradients of any spec (``_GRAD_SCALE`` per value: about 0.2 for a few hundred values),
# so every held step is really scaled
CLIPNORM = 0.05
COMPUTE_MODES = ("real", "emulated")
_GRAD_SCALE = 0.01


@dataclass(frozen=True)
class EmulatedModelDef:
    """What an emulated worker needs: the ModelSpec, its compute time and an optimizer.

    Attributes:
        spec: variables (names, shapes, dtypes, sparsity, rows per step) and ready order.
        step_time_s: seconds each step's compute takes (already dilated).
        optimizer: a key of ``OPTIMIZERS``.
        seed: of the synthetic gradients and sparse rows (and PowerSGD's shared seed).
    """

    spec: ModelSpec
    step_time_s: float
    optimizer: str = "sgd"
    seed: int = 0
    metadata: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        problems = []
        if not (isinstance(self.step_time_s, (int, float)) and 0 <= self.step_time_s < 3600):
            problems.append(f"emulated step time must be a number of seconds in [0, 3600), got {self.step_time_s!r}")
        bf16 = [v.name for v in self.spec.variables if v.dtype == "bfloat16"][:3]
        if bf16:
            problems.append(f"emulated compute cannot make bfloat16 gradients (numpy has no bfloat16): {bf16}")
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"optimizer {self.optimizer!r} for emulated compute is not one of {', '.join(OPTIMIZERS)}")
        if problems:
            raise ConfigError(problems)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def batch_size(self) -> int:
        return self.spec.batch_size


def emulated_optimizer(model_def: EmulatedModelDef) -> dict:
    """The Keras optimizer config the channels of an emulated model apply: ``OPTIMIZERS``' entry,
    with ``global_clipnorm`` = ``CLIPNORM`` where the spec's model clips by the global norm."""
    config = dict(OPTIMIZERS[model_def.optimizer])
    if model_def.spec.global_clipnorm:
        config["global_clipnorm"] = CLIPNORM
    return config


def emulated_model_def(spec: ModelSpec, cluster: ClusterSpec, step_time_s: float | None = None,
                       optimizer: str = "sgd", seed: int = 0) -> EmulatedModelDef:
    """The emulated model for ``spec`` on ``cluster``: compute time ``step_time_s`` (default: the
    spec's ``profile.step_time_s``) times the cluster's ``compute_dilation``.

    Raises:
        ConfigError: no step time (no profile and no override), or bad values.
    """
    if step_time_s is None:
        if spec.profile is None:
            raise ConfigError(f"model {spec.name} has no profile.step_time_s, which emulated compute waits each "
                              f"step; add `profile: {{step_time_s: SECONDS}}` to its model-spec YAML, give "
                              f"--step-time SECONDS, or use a trainable model (zoo:NAME) whose compute is measured")
        step_time_s = spec.profile.step_time_s
    if problem := _step_time_problem(step_time_s):
        raise ConfigError(problem)
    dilation = getattr(cluster, "compute_dilation", 1.0)
    return EmulatedModelDef(spec, float(step_time_s) * dilation, optimizer, seed)


def check_emulated_settings(step_time_s: float | None, optimizer: str) -> None:
    """What emulated compute takes beside the model (``--step-time``, None: the spec's;
    ``--optimizer``), checked before any model is read.

    Raises:
        ConfigError: a step time that is not a number of seconds >= 0, or an unknown optimizer
            (both said at once).
    """
    problems = [_step_time_problem(step_time_s) if step_time_s is not None else None,
                None if isinstance(optimizer, str) and optimizer in OPTIMIZERS else
                f"optimizer {optimizer!r} for emulated compute is not one of {', '.join(OPTIMIZERS)}"]
    if any(problems):
        raise ConfigError([p for p in problems if p])


def _step_time_problem(step_time_s) -> str | None:
    if isinstance(step_time_s, (int, float)) and not isinstance(step_time_s, bool) and step_time_s >= 0:
        return None
    return f"--step-time must be a number of seconds >= 0, got {step_time_s!r}"


def distinct_zipf_rows(rng: np.random.Generator, vocab: int, rows: int) -> np.ndarray:
    """``rows`` distinct ids in ``[0, vocab)``, sorted, drawn Zipf-like (as the zoo data draws ids):
    frequent ids first, rare ones filling up when few distinct ids are drawn."""
    from autosync.models.batches import zipf_ids

    if rows >= vocab:
        return np.arange(vocab, dtype=np.int64)
    got = np.empty(0, dtype=np.int64)
    for _ in range(8):
        draw = np.concatenate([got, zipf_ids(rng, vocab, 2 * rows).astype(np.int64)])
        _, first = np.unique(draw, return_index=True)
        got = draw[np.sort(first)]
        if len(got) >= rows:
            return np.sort(got[:rows])
    rest = np.setdiff1d(np.arange(vocab, dtype=np.int64), got)
    return np.sort(np.concatenate([got, rng.choice(rest, rows - len(got), replace=False)]))


def rows_per_step(spec: ModelSpec, v: int) -> int:
    """Rows a step touches in sparse variable ``v`` (default: the batch size, at most the rows)."""
    var = spec.variables[v]
    return var.rows_per_step or min(spec.batch_size, var.shape[0])


def step_rows(spec: ModelSpec, seed: int, worker: int, step: int) -> dict[int, np.ndarray]:
    """Sparse variable index -> the rows worker ``worker`` touches at ``step``."""
    rng = np.random.default_rng([seed, worker, step, 0x5EED])
    return {v: distinct_zipf_rows(rng, var.shape[0], rows_per_step(spec, v))
            for v, var in enumerate(spec.variables) if var.sparse and var.is_float}


def base_gradients(spec: ModelSpec, seed: int, worker: int) -> list:
    """Per variable: the dense gradient, the block of sparse row values, or None (not a float)."""
    out = []
    for v, var in enumerate(spec.variables):
        if not var.is_float:
            out.append(None)
            continue
        shape = (rows_per_step(spec, v),) + var.shape[1:] if var.sparse else var.shape
        rng = np.random.default_rng([seed, worker, v])
        g = rng.standard_normal(shape, dtype=np.float32)
        g *= np.float32(_GRAD_SCALE)        # in place: one array of a full-size model's size, not three
        out.append(g.astype(var.dtype, copy=False))
    return out


def synthetic_gradients(spec: ModelSpec, seed: int, worker: int, step: int, base: list | None = None) -> list:
    """The gradients worker ``worker`` hands over at ``step``, model order: dense ndarray,
    ``(indices, values)`` for sparse variables, None for non-float ones."""
    base = base if base is not None else base_gradients(spec, seed, worker)
    rows = step_rows(spec, seed, worker, step)
    return [(rows[v], g) if v in rows else g for v, g in enumerate(base)]


class EmulatedWorker:
    """A training replica without TensorFlow (see the module doc); wrapped with ``ray.remote``.

    Args:
        num_cpus: CPUs the actor was given (kept for the same constructor as ``TrainingWorker``).
    """

    def __init__(self, num_cpus: float):
        self.threads = max(1, int(num_cpus))
        self.model_def: EmulatedModelDef | None = None
        self.channels: list = []
        self.step = 0
        self._parts: dict = {}
        self._partial = False
        self._early_collectives: list = []

    def timeline(self, record: bool) -> dict | None:
        """Start recording this worker's timeline, or stop and return it (``timeline.toggle``)."""
        return timeline.toggle(record)

    def info(self) -> dict:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), "compute": "emulated"}

    def load(self, model_def: EmulatedModelDef, worker_index: int, num_workers: int,
             send_initial: bool = True) -> dict:
        """Prepare the synthetic gradients; returns the description ``TrainingWorker.load`` does
        (with ``send_initial``, its zero initial values as ``ZeroInitial``: no arrays)."""
        spec = model_def.spec
        self.model_def, self.worker_index = model_def, worker_index
        self.base = base_gradients(spec, model_def.seed, worker_index)
        names = ready_order(spec)
        self.order = [spec.index(n) for n in names]
        return {
            "variables": [{"name": v.name, "shape": list(v.shape), "dtype": v.dtype, "sparse": v.sparse,
                           "rows": v.rows_per_step if v.sparse else None} for v in spec.variables],
            "optimizer": emulated_optimizer(model_def),
            "initial": [ZeroInitial(tuple(v.shape), v.dtype) for v in spec.variables] if send_initial else None,
            "initial_digest": zeros_digest([(v.shape, v.dtype) for v in spec.variables]),
        }

    def reset(self, worker_index: int, num_workers: int, channels: list, layout: list,
              description: dict | None = None, parts: tuple | None = None) -> None:
        """See ``TrainingWorker.reset`` (``description`` is not needed: the initial values are zeros;
        ``parts`` must be None: synthetic gradients are drawn per worker, not from data parts)."""
        if parts is not None:
            raise ValueError("an emulated worker draws no data: it cannot keep the global batch of more workers")
        if worker_index != self.worker_index:
            self.base = base_gradients(self.model_def.spec, self.model_def.seed, worker_index)
            self.worker_index = worker_index
        self.channels = channels
        # under global clipping a step is held unless the graph carries all of it (as a TensorFlow worker)
        clip = emulated_optimizer(self.model_def).get("global_clipnorm")
        self._clip = clip if clip is not None and channels and not all(c.in_graph for c in channels) else None
        self.layout = [tuple(x) for x in layout]
        self.step = 0
        self._parts = {}
        self._partial = False
        self.rows: dict[int, np.ndarray] = {}
        self._early_collectives = early_collectives(self.model_def.spec, channels, self.layout) if self._clip is None else []
        # beside them the parameter servers' push leaves when its gradients are ready (``early_push``)
        self._early = EarlyPush(early_channels(channels, bool(self._early_collectives), self._clip is not None, 1),
                                channels)
        times, spec = ready_times(self.model_def.spec), self.model_def.spec
        self._early_at = max((times[spec.variables[v].name] for v in self._early.carries), default=1.0)

    def run(self, steps: int) -> dict:
        """Run ``steps`` steps (see the module doc), then pull the final values.

        Returns:
            the same per-step lists as ``TrainingWorker.run`` (``loss`` is 0: there is none).
        """
        md = self.model_def
        out = {"start": [], "compute": [], "sync": [], "loss": [], "calls": [], "bytes_sent": [],
               "bytes_received": []}
        counters = lambda: (sum(c.calls for c in self.channels), sum(c.bytes_sent for c in self.channels),  # noqa: E731
                            sum(c.bytes_received for c in self.channels))
        for _ in range(steps):
            before = counters()
            t0 = time.time()
            out["start"].append(t0)
            # the rows this step reads and writes, known before its pull: only they are pulled
            self.rows = step_rows(md.spec, md.seed, self.worker_index, self.step)
            timeline.at_step(self.step)
            with timeline.span("pull", step=self.step):
                self._pull(self.step, rows=self.rows)
            t1 = time.perf_counter()
            grads = self._gradients()
            self._early.arm(self.step)
            if self._early.channels:
                self._early.after(t1 + self._early_at * md.step_time_s - time.perf_counter(), grads)
            for at, channel, index in self._early_collectives:   # while the compute runs
                wait = t1 + at * md.step_time_s - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                with timeline.span("allreduce (in step)", step=self.step):
                    channel.reduce_early(self.step, grads, index)
            left = md.step_time_s - (time.perf_counter() - t1)
            if left > 0:
                time.sleep(left)
            # the compute's own time, also when a collective issued during it ran past its end
            compute = time.perf_counter() - t1 if left > 0 else md.step_time_s
            timeline.add("compute", t1, t1 + compute, step=self.step)
            self._early.done(grads)
            hand_over(self._early.rest, self.step, grads, self._clip)
            out["compute"].append(compute)
            out["sync"].append(time.time() - t0 - compute)
            out["loss"].append(0.0)
            for key, b, a in zip(("calls", "bytes_sent", "bytes_received"), before, counters()):
                out[key].append(a - b)
            self.step += 1
        # the final pull waits for every worker's last update, on no rows of the sparse tables
        # (get_weights pulls them whole when asked)
        self._pull(self.step, fresh=True, rows={v: np.zeros(0, np.int64) for v in self.rows})
        for channel in self.channels:
            channel.finish()
        out["start"].append(time.time())
        return out

    def get_weights(self) -> list:
        """The trainable variables' last pulled values, model order (row-pulled tables are
        pulled whole first; a variable no channel holds is at its initial zeros)."""
        if self._partial:
            self._pull(self.step, fresh=True)
        out = []
        for v, (shards, axis) in enumerate(self.layout):
            var = self.model_def.spec.variables[v]
            if all((v, i) in self._parts for i in range(shards)):
                parts = [np.asarray(self._parts[(v, i)]) for i in range(shards)]
                out.append(parts[0] if shards == 1 else np.concatenate(parts, axis=axis))
            else:
                out.append(np.zeros(var.shape, dtype=var.dtype))
        return out

    def _gradients(self) -> list:
        """This step's gradients, model order, built in gradient-ready order (views: no copies)."""
        grads: list = [None] * len(self.base)
        for v in self.order:
            g = self.base[v]
            if g is not None:
                grads[v] = (self.rows[v], g) if v in self.rows else g
        return grads

    def _pull(self, step: int, fresh: bool = False, rows: dict | None = None) -> None:
        """Pull from every channel. Whole shards are kept (for ``get_weights``); row pulls only
        move the rows (nothing here reads values: the gradients are synthetic)."""
        self._partial = False
        for channel in self.channels:
            for key, part in channel.pull(step, fresh=fresh, rows=rows).items():
                if isinstance(part, tuple):
                    self._partial = True
                else:
                    self._parts[key] = part


def early_collectives(spec: ModelSpec, channels: list, layout: list) -> list[tuple[float, object, int]]:
    """The collectives an emulated worker issues while its compute runs (module doc, step 4), in
    issue order: ``(ready time as a share of the compute, all-reduce channel, group index)`` for
    each fusion group whose members a GPU worker reduces inside its step."""
    from autosync.runtime.sync.allreduce import AllReduceChannel, split_by

    times = ready_times(spec)
    names = [v.name for v in spec.variables]
    out = []
    for channel in channels:
        if not isinstance(channel, AllReduceChannel):
            continue
        inside, _ = split_by(list(channel.groups), list(layout), lambda m: m.in_step)
        early = {m.key for g in inside for m in g.members}
        for index, g in enumerate(channel.groups):
            if all(m.key in early for m in g.members):
                out.append((max(times[names[m.key[0]]] for m in g.members), channel, index))
    return out


def worker_class(model_def) -> type:
    """The actor class that runs ``model_def``: ``EmulatedWorker`` or ``TrainingWorker``."""
    if isinstance(model_def, EmulatedModelDef):
        return EmulatedWorker
    from autosync.runtime.worker import TrainingWorker

    return TrainingWorker
