"""The training worker actor: one per replica; builds the Keras model and computes gradients.

A worker process imports TensorFlow once (seconds), so the runtime keeps workers warm across
trials; ``load`` builds a model, ``reset`` starts a trial from the initial weights and a fresh data
iterator, and ``run`` executes steps against the trial's synchronization channels.

A step draws its batch first, so that for the sparse variables whose lookups are predictable
(``autosync.runtime.rows``) it pulls only the rows the batch reads; the worker's copy of such a
table is current on those rows only, until ``get_weights`` pulls it whole.
"""
from __future__ import annotations

import os
import time
from functools import reduce

import numpy as np

from autosync.models.fit_batch import batch_loss, check_model
from autosync.runtime.digest import weights_digest
from autosync.runtime.fast_call import FlatFunction, JoinedAssign, RowAssign
from autosync.runtime.loss_scale import LossScale, per_worker, scaled_gradients, unwrapped, wrapped_for_policy
from autosync.runtime.optimizer_config import keras_optimizer_config
from autosync.runtime import data_parts, prefetch, random_seeds, timeline
from autosync.runtime.host_gradients import add, divide, to_numpy
from autosync.runtime.pulled import join_pulled
from autosync.runtime.rows import check_pulled_rows, check_row_ids, find_row_reads
from autosync.runtime.sync.base import across_collective, hand_over
from autosync.runtime.sync.early_push import EarlyPush, early_channels
from autosync.runtime.worker_checkpoint import WorkerCheckpoint


LOAD_MIN_S = 5.0   # a load left less of the trial's limit than this runs unbounded (``load_within``)


class TrainingWorker(WorkerCheckpoint):
    """State of one training replica (wrapped with ``ray.remote`` by the runtime).

    Args:
        num_cpus: CPUs this actor was given; TensorFlow's thread pools are sized to it before
            TensorFlow runs anything in this process.
    """

    def __init__(self, num_cpus: float):
        threads = max(1, int(num_cpus))
        from autosync.runtime.lean_import import skip_keras_extras
        from autosync.tflog import quiet_startup

        skip_keras_extras()   # Keras' scikit-learn, matplotlib and pandas integrations: 2.3 s of this import
        quiet_startup()   # TensorFlow's start-up lines, unless AUTOSYNC_TF_LOGS=1 (inherited from the driver)
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        # two at least: an in-graph collective is launched by an inter-op thread, and with one
        # it waits for whatever long gradient op runs (no overlap with the backward pass)
        tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))
        self.threads = threads
        self.model_def = None
        self.model = None
        self.channels: list = []
        self.step = 0
        self._partial = False  # some row-pulled tables are current only on the rows last read
        self._drawing = False  # in the user's dataset_fn (``_next_batch``)

    def timeline(self, record: bool) -> dict | None:
        """Start recording this worker's timeline, or stop and return it (``timeline.toggle``)."""
        return timeline.toggle(record)

    def info(self) -> dict:
        """Where this worker runs, and its process's threads (None where the OS does not say)."""
        import ray
        import tensorflow as tf

        threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None   # (Linux)
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), "threads": threads,
                "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
                "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads()}

    def collective_address(self) -> str:
        """Where this worker's TensorFlow server will listen (``host:port``)."""
        from autosync.runtime.sync.tf_collective import free_address

        return free_address()

    def join_collective(self, rank: int, addresses: list) -> str:
        """Join the workers' TensorFlow cluster (before ``load``); see ``tf_collective.join``."""
        from autosync.runtime.sync.tf_collective import join

        return join(rank, addresses)

    def load_within(self, stop_at: float, model_def, worker_index: int, num_workers: int,
                    send_initial: bool = True) -> dict:
        """``load``, its user code stopped at ``stop_at`` (``time.time()``: the trial's deadline less a
        margin): a hang in ``model_fn`` or ``dataset_fn`` times the trial out saying where it hung,
        before the driver's wait would end with only "time limit reached" (``autosync.time_limit``)."""
        from autosync.time_limit import bounded

        left = stop_at - time.time()
        if left < LOAD_MIN_S:   # the process's start took the trial's time: the driver's wait says so
            return self.load(model_def, worker_index, num_workers, send_initial)
        with bounded(f"ModelDef {model_def.name}: worker {worker_index} building the model and drawing its first "
                     f"batches", seconds=left, in_worker=True,
                     longer="give the trial longer (--timeout, trial_timeout_s, timeout_s)"):
            return self.load(model_def, worker_index, num_workers, send_initial)

    def run_within(self, stop_at: float, steps: int) -> dict:
        """``run``, its data draws stopped at ``stop_at`` (as ``load_within``): a ``dataset_fn``
        that hangs in a later batch times the trial out saying where. Only the draws: a worker
        waiting on another (whose data hung) is not stopped, so the trial names the one that hung."""
        from autosync.time_limit import bounded

        left = stop_at - time.time()
        if left < LOAD_MIN_S:
            return self.run(steps)
        with bounded(f"ModelDef {self.model_def.name}: worker {self._data[0]} running {steps} training steps, drawing "
                     f"their batches from dataset_fn,", seconds=left, in_worker=True, gate=lambda: self._drawing,
                     where=self._where_drawing, longer="give the trial longer (--timeout, trial_timeout_s, timeout_s)"):
            return self.run(steps)

    def _where_drawing(self, frame) -> str:
        """Where a data draw was stopped: in the thread drawing ahead (``prefetch``), else ``frame``."""
        from autosync.time_limit import where_stopped

        drawing = getattr(self.batches, "drawing_frame", None)
        return where_stopped((drawing and drawing()) or frame)

    def load(self, model_def, worker_index: int, num_workers: int, send_initial: bool = True) -> dict:
        """Build the model from its seed and probe one gradient.

        Args:
            send_initial: return the initial values themselves (else only their digest: the
                driver needs one worker's copy, and every worker's digest to compare).

        Returns:
            ``{"variables": [{name, shape, dtype, sparse}], "optimizer": config, "initial": [arrays] or None,
            "initial_digest": str, "batch_digest": str (``data_check``), "row_pull": [names], "full_pull": {name:
            reason}}`` (trainable variables in model order; ``row_pull``: sparse variables whose rows a step
            reads are known before it runs, pulled alone; ``full_pull``: sparse ones pulled whole, and why).
        """
        import keras
        import tensorflow as tf

        self.model_def = model_def
        keras.utils.set_random_seed(model_def.seed)
        self.model = model_def.build_model()
        check_model(self.model, f"ModelDef {model_def.name}")
        self._seeds = random_seeds.initial_states(self.model)   # each trial's random streams start here
        self.loss = model_def.loss()
        optimizer = wrapped_for_policy(model_def.optimizer_fn(), self.model)   # as Keras' compile would
        inner, self._scaling = unwrapped(optimizer)   # dynamic loss scaling's settings, or None
        self._factor = getattr(inner, "loss_scale_factor", None)   # a fixed loss scale, or None
        model, loss_fn = self.model, self.loss
        # what the step multiplies the loss by (``loss_scale.per_worker``): set when it changes
        self._scale = None if self._scaling is None and self._factor is None else tf.Variable(1.0, trainable=False)
        scale = self._scale

        @tf.function(autograph=False)
        def gradients(x, y):
            with tf.GradientTape() as tape:
                loss = batch_loss(model, loss_fn, x, y)
            return loss, scaled_gradients(tape, loss, model.trainable_variables, scale)

        self._clipnorm = getattr(inner, "global_clipnorm", None)
        # Keras' gradient accumulation: a step draws this many batches and syncs their mean once
        # (outside the graph; in the graph Keras accumulates itself, see ``_gradients_of``)
        self.accumulate = int(getattr(inner, "gradient_accumulation_steps", None) or 1)
        x, y = next(model_def.batches(worker_index, num_workers))
        # build the model in inference mode first and keep its non-trainable state: the probe below
        # runs in training mode, which moves BatchNormalization's statistics; step 0 starts from these
        model(x, training=False)   # before the worker's own seeds: weights built lazily come out alike
        first = next(self._batches(worker_index, num_workers))   # what its first step will draw
        before = {id(w): np.array(w.numpy()) for w in model.weights if not w.trainable}
        _, grads = gradients(x, y)  # traces once; finds which gradients are sparse
        self.variables = list(model.trainable_variables)
        self._leading = [v.shape[0] if len(v.shape) else 1 for v in self.variables]   # rows (Keras' shape is slow)
        trainable = {id(v) for v in self.variables}
        # the worker keeps the initial values of the non-trainable weights only (counters, moving
        # statistics: small); the trainable ones come with every reset from the pool's copy in
        # the object store, one per node, instead of one private copy of the tables per worker
        self._fixed = [(w, before.get(id(w), np.array(w.numpy()))) for w in model.weights if id(w) not in trainable]
        for weight, value in self._fixed:
            weight.assign(value)
        self._trained = False
        initial = [np.asarray(v.numpy()) for v in self.variables]   # (a scalar variable: a 0-d array)
        sparse = [isinstance(g, tf.IndexedSlices) for g in grads]
        self.row_reads = find_row_reads(model, self.variables, sparse)
        # the per-step calls, past tf.function's per-call dispatch (``fast_call``)
        self._gradients = FlatFunction(gradients, (x, y))
        self._assign = JoinedAssign(self.variables, initial)   # one graph call, small values joined
        self._assign_rows = self._row_assigner(initial)
        if hasattr(self.row_reads.ids, "python_function"):   # a tf.function (``rows``: not where ids are inputs)
            self.row_reads.ids = FlatFunction(self.row_reads.ids, (x,))
        return {
            # a sparse variable's distinct rows in this first batch: what its shard's push and pull
            # weigh per step, for PS pipelining (``sync.ps.pipelined_sparse``)
            "variables": [{"name": v.path, "shape": list(v.shape), "dtype": str(v.dtype), "sparse": s,
                           "rows": int(np.unique(g.indices.numpy()).size) if s else None}
                          for v, s, g in zip(self.variables, sparse, grads)],
            "optimizer": keras_optimizer_config(optimizer, self.variables),
            "initial": initial if send_initial else None,
            "initial_digest": weights_digest(initial),
            "batch_digest": weights_digest([np.asarray(a) for a in tf.nest.flatten(first)]),
            "row_pull": [self.variables[i].path for i in sorted(self.row_reads.outputs)],
            "full_pull": dict(self.row_reads.full_pull),
        }

    def _set_scale(self) -> None:
        """Give the step the loss scale (dynamic scaling's current one, or the fixed one) over the workers."""
        if self._scale is not None:
            start = self._factor if self._scaling is None else self._scaling["initial_scale"]
            self._scale_set = self._loss_scale.scale if self._loss_scale else np.float32(start)
            self._scale.assign(per_worker(self._scale_set, self._data[1]))

    def _row_assigner(self, initial: list) -> RowAssign:
        """One graph call that assigns whole variables and scatters the pulled rows of the
        row-pulled ones (``fast_call.RowAssign``)."""
        rows = sorted(self.row_reads.outputs)
        return RowAssign(self.variables, [i for i in range(len(self.variables)) if i not in self.row_reads.outputs],
                         rows, initial)

    def reset(self, worker_index: int, num_workers: int, channels: list, layout: list,
              description: dict | None = None, parts: tuple | None = None) -> None:
        """Start from the initial weights with a fresh data iterator and the given channels;
        ``layout[v]`` is variable v's (number of shards, partition axis).

        Args:
            description: what ``load`` returned with ``send_initial`` (its ``initial`` values, read
                from the object store without a copy); None only before the model trained.
            parts: ``(its data parts, how many there are)``: each step draws the batches of each
                (``data_parts``); None: its own, ``dataset_fn(worker_index, num_workers)``.

        Raises:
            ValueError: no ``description`` although the model has trained since ``load``.
        """
        if description is not None:
            # one variable at a time: a transient tensor of one table at most, never of all
            for var, value in zip(self.variables, description["initial"]):
                var.assign(value)
        elif self._trained:
            raise ValueError("reset needs the model's initial values (the pool's description) once it has trained")
        for weight, value in self._fixed:
            weight.assign(value)
        random_seeds.assign([v for v, _ in self._seeds],
                            [random_seeds.worker_state(initial, worker_index) for _, initial in self._seeds])
        self._data = (worker_index, num_workers)
        self._parts = (tuple(parts[0]), int(parts[1])) if parts else ((worker_index,), num_workers)
        self.batches = prefetch.restart(getattr(self, "batches", None), self._stream())
        self.drawn = 0   # batches drawn from ``batches`` (the data position a checkpoint keeps)
        for old in getattr(self, "channels", ()):   # a test may build a worker without __init__
            old.close()
        self.channels = channels
        # global_clipnorm or dynamic loss scaling beside other channels: every channel holds its step
        # until the scale is known (``sync.base``); in the graph alone Keras clips itself and the
        # step applies only finite gradients (``step_finite``)
        graph_alone = len(channels) == 1 and channels[0].in_graph
        self._loss_scale = LossScale(**self._scaling) if self._scaling and channels else None
        self._hold = bool(channels) and not graph_alone and (self._loss_scale is not None or self._clipnorm is not None)
        self._clip = self._clipnorm if self._hold else None
        self._set_scale()
        # a channel that synchronizes inside the graph supplies the step (its gradients come back None)
        inner = unwrapped(self.model_def.optimizer_fn())[0]
        inner.loss_scale_factor = None   # a fixed loss scale (``loss_scale``): the step unscales the gradients itself
        # beside collectives in the step, the parameter servers' push leaves from inside it (``early_push``)
        self._early = EarlyPush(early_channels(channels, any(c.in_graph for c in channels), self._hold,
                                               self.accumulate * len(self._parts[0])), channels)
        early = self._early if self._early.channels else None
        self._compute = next((c.bind(self.model, self.loss, inner, hold=self._hold, scale=self._scale,
                                     skips=self._scaling is not None, early=early)
                              for c in channels if c.in_graph), self._gradients)
        self.layout = [tuple(x) for x in layout]
        self.step = 0
        self._partial = False

    def run(self, steps: int) -> dict:
        """Run ``steps`` training steps, then pull the final values.

        Returns:
            per-step lists ``start`` (UNIX time at each step start, plus one after the final
            pull), ``compute``, ``sync`` (seconds), ``loss``, ``calls`` (Ray calls made) and
            ``bytes_sent``/``bytes_received`` (array payload bytes the step moved).
        """
        out = {"start": [], "compute": [], "sync": [], "loss": [], "calls": [], "bytes_sent": [],
               "bytes_received": []}
        counters = lambda: (sum(c.calls for c in self.channels), sum(c.bytes_sent for c in self.channels),  # noqa: E731
                            sum(c.bytes_received for c in self.channels))
        self._trained = True
        # with staleness >= 1 on every channel, step t+1's batch is drawn and its pull issued
        # before step t computes, so the pull overlaps the step (never across run calls)
        pull_ahead = bool(self.channels) and all(c.splits_pull and c.staleness >= 1 for c in self.channels)
        # beside a collective reduced after the step (an all-reduce channel), step t+1's pulls
        # are issued once step t's pushes are out, before its collective: their values cross the
        # network while the collective runs instead of after it (``across_collective``)
        across = not pull_ahead and not self._hold and across_collective(self.channels)
        ahead = None
        for i in range(steps):
            before = counters()
            t0 = time.time()
            out["start"].append(t0)
            timeline.at_step(self.step)
            with timeline.span("pull", step=self.step):
                if ahead is None:
                    batches, rows = self._draw()
                    self._assign_pulled(self.step, rows=rows)
                else:
                    batches, rows, pending = ahead
                    self._assign_pulled(self.step, rows=rows, pending=pending)
                    ahead = None
            if pull_ahead and i + 1 < steps:
                nbatches, nrows = self._draw()
                ahead = (nbatches, nrows, [c.start_pull(self.step + 1, rows=nrows) for c in self.channels])
            self._early.arm(self.step, lambda g, rows=rows: check_pulled_rows(self.variables, rows, g))
            t1 = time.perf_counter()
            loss, grads = self._gradients_of(batches)
            compute = time.perf_counter() - t1
            timeline.add("compute", t1, t1 + compute, step=self.step)
            check_pulled_rows(self.variables, rows, grads)
            self._early.done(grads)
            if across and i + 1 < steps:
                hand_over([c for c in self._early.rest if c.splits_pull], self.step, grads, None)
                nbatches, nrows = self._draw()
                pending = [c.start_pull(self.step + 1, rows=nrows) if c.splits_pull else None for c in self.channels]
                ahead = (nbatches, nrows, pending)
                hand_over([c for c in self._early.rest if not c.splits_pull], self.step, grads, None)
            else:
                hand_over(self._early.rest, self.step, grads, self._clip, self._loss_scale if self._hold else None)
                if self._loss_scale is not None and not self._hold:   # the graph alone decided in the step
                    self._loss_scale.after(self.channels[0].step_finite())
                if self._loss_scale is not None and self._loss_scale.scale != self._scale_set:
                    self._set_scale()
            out["compute"].append(compute)
            out["sync"].append(time.time() - t0 - compute)
            out["loss"].append(float(loss))
            for key, b, a in zip(("calls", "bytes_sent", "bytes_received"), before, counters()):
                out[key].append(a - b)
            self.step += 1
        self._pull_all()   # the final pull waits for every worker's last update: the model ends synchronized
        for channel in self.channels:
            channel.finish()
        out["start"].append(time.time())
        return out

    def finalize(self) -> None:
        """The end of ``fit`` under the optimizer's ``use_ema``, after the parameter servers': the
        channels take their moving averages and the model pulls every value again."""
        for channel in self.channels:
            channel.finalize()
        self._pull_all()

    def _pull_all(self) -> None:
        """Pull every value fresh (row-pulled tables on no rows: ``get_weights`` pulls them whole
        when asked)."""
        none = {v: np.zeros(0, np.int64) for v in self.row_reads.outputs}
        self._assign_pulled(self.step, fresh=True, rows=none)
        self._partial = bool(none)

    def _batches(self, worker_index: int, num_workers: int):
        """This worker's batches from the start, drawn under its own seed (``random_seeds.seeded``)."""
        seed = random_seeds.worker_seed(self.model_def.seed, worker_index)
        return random_seeds.seeded(seed, self.model_def.batches(worker_index, num_workers))

    def _stream(self):
        """This worker's batches from the start: its own part's, or each of its parts' in turn."""
        parts, n = self._parts
        if (parts, n) == ((self._data[0],), self._data[1]):
            return self._batches(*self._data)
        return data_parts.interleaved([self._batches(p, n) for p in parts], self.accumulate)

    def _next_batch(self):
        self.drawn += 1
        self._drawing = True   # the user's code runs (``run_within``)
        try:
            return next(self.batches)
        finally:
            self._drawing = False

    def _draw(self) -> tuple[list, dict]:
        """The next step's batches (``accumulate`` of them: the optimizer's
        ``gradient_accumulation_steps``) and the rows of the row-pulled variables they read."""
        batches = [self._next_batch() for _ in range(self.accumulate * len(self._parts[0]))]
        reads = [self.row_reads.rows(x) for x, _ in batches]
        for k, r in enumerate(reads):
            check_row_ids(self.variables, r, self.drawn - len(reads) + k + 1)
        return batches, {v: reduce(np.union1d, [r[v] for r in reads]) for v in reads[0]}

    def _gradients_of(self, batches: list) -> tuple[float, list]:
        """The mean loss and gradient of a step's batches, as Keras accumulates them: summed in
        order and divided by their number (a sparse gradient's slices concatenated); a worker
        holding several data parts hands over their sum over its share of the parts instead."""
        losses, total = [], None
        for x, y in batches:
            loss, grads = self._compute(x, y)
            losses.append(float(loss))
            grads = [to_numpy(g) for g in grads]
            total = grads if total is None else [add(a, b) for a, b in zip(total, grads)]
        share = len(self._parts[0]) * self._data[1] / self._parts[1]   # 1 with a part of its own
        if len(batches) != share:
            total = [divide(g, len(batches) / share) for g in total]
        # (the loss likewise: the workers' mean is then the parts')
        return float(np.mean(losses)) * share, total

    def get_weights(self) -> list:
        """All model weights (``model.get_weights()`` order), row-pulled tables pulled whole."""
        if self._partial:
            self._assign_pulled(self.step, fresh=True)
            self._partial = False
        return self.model.get_weights()

    def _assign_pulled(self, step: int, fresh: bool = False, rows: dict | None = None, pending=None) -> None:
        """Pull (or, given ``pending``, finish the pulls each channel started) and assign."""
        parts: dict = {}
        for i, channel in enumerate(self.channels):
            # a channel without a pull in ``pending`` (None) pulls now: an all-reduce channel's
            # values are its own, updated by the step's push
            parts.update(channel.pull(step, fresh=fresh, rows=rows) if pending is None or pending[i] is None
                         else channel.finish_pull(pending[i]))
        pulled = join_pulled(parts, self.layout, self._leading)
        by_rows = self.row_reads.outputs
        if len(pulled) < len(self.variables):
            self._assign_each(pulled)
        elif not by_rows:
            self._assign([pulled[i] for i in range(len(self.variables))])
        elif all(isinstance(pulled[v], tuple) for v in by_rows):
            order = sorted(by_rows)
            self._assign_rows([pulled[i] for i in range(len(self.variables)) if i not in by_rows],
                              [pulled[v][0] for v in order], [pulled[v][1] for v in order])
        else:
            self._assign_each(pulled)

    def _assign_each(self, pulled: dict) -> None:
        import tensorflow as tf

        for i, value in pulled.items():
            if isinstance(value, tuple):
                self.variables[i].value.scatter_update(tf.IndexedSlices(value[1], value[0]))
            else:
                self.variables[i].assign(value)
