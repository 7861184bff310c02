"""The training state of a running ``Session``, read from and written back into its actors: what a
checkpoint holds (``autosync.runtime.checkpoint`` puts it on disk).

Arrays are named for ``state.npz``: ``ps/<actor>/<var>.<shard>/<slot>`` for a parameter server's
optimizer slots, ``channel<c>/<name>`` for the state of worker channel ``c`` (all-reduced
variables' optimizer, taken from worker 0: every worker holds the same),
``compressors/<w>/channel<c>/<name>`` for worker ``w``'s compressor memory (its own: error-feedback
residuals, PowerSGD's warm-start Qs; a restore under another strategy starts it afresh), ``seeds/<w>/<i>`` for
worker ``w``'s state of the model's ``i``-th random-layer generator (``random_seeds``: each
worker's own), ``loss_scale`` for dynamic loss scaling's ``[scale, counter, skipped]`` (worker 0's:
every worker holds the same). Reads and writes happen between round trips, when no step is in flight.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from autosync.runtime import data_parts, reshard, weights_file
from autosync.runtime.engine import Session, wait_all
from strategy_space.errors import ConfigError


# a checkpoint reads the actors' arrays in batches of about this many bytes (a bigger array alone):
# what it holds at once, in the actor, the object store and the driver, stays bounded whatever
# the size of the model (a 2 GB embedding table with its Adagrad slots is not copied whole)
BATCH_BYTES = 256 * 2 ** 20


@dataclass
class SessionState:
    """A training state to load (``load``), as read from a checkpoint.

    Attributes:
        weights: the model's weights in ``get_weights`` order: arrays, the variables of a Keras
            model holding them (``model.weights``) or a weights file's datasets, each read when
            it is sent.
        positions: per worker (replica order), batches drawn from its data iterator.
        arrays: name -> array (see the module doc); a mapping read on access is enough.
        ps_versions: PS actor name -> ``{"version", "chunk_version"}``.
    """

    weights: list
    positions: tuple
    arrays: Mapping
    ps_versions: dict


@dataclass
class Snapshot:
    """The state of a running session as ``snapshot`` found it: counters and positions read,
    arrays read on demand (``weights``, ``arrays``), ``BATCH_BYTES`` at a time.

    Attributes:
        positions: per worker (replica order), batches drawn from its data iterator.
        ps_versions: PS actor name -> ``{"version", "chunk_version"}``.
        read_s: seconds spent waiting for the actors' arrays so far.
        seeds: per worker (replica order), its random layers' generator states.
        layout: the weights file's layout as worker 0 walked it (``weights_file.layout``: None
            when Keras could not say).
    """

    session: Session
    deadline: float | None
    positions: tuple
    ps_versions: dict
    weight_specs: list
    trainable: list
    layout: list | None = None
    ps_sizes: dict = field(default_factory=dict)
    channel_sizes: list = field(default_factory=list)
    read_s: float = 0.0
    seeds: tuple = ()
    loss_scale: list | None = None
    canonical: dict = field(default_factory=dict)

    def state_index(self) -> dict:
        """What each optimizer array of ``arrays`` holds, as a checkpoint keeps it for a restore
        under another strategy (``reshard.state_index``)."""
        shapes = [spec[0] for spec in (self.weight_specs[i] for i in self.trainable)]
        return reshard.state_index(self.canonical, self.session.plan, shapes)

    def weights(self):
        """``(index, array)`` of each model weight (``get_weights`` order): worker 0's, but the
        parts its parameter servers hold read from them (a worker's row-pulled tables are fresh
        only in the rows it last read), one variable at a time."""
        held: dict = {}   # model weight index -> [(PS actor, its name, shard)]
        for actor, p in zip(self.session.ps_actors, self.session.plan.ps_actors):
            for r in p.shards:
                held.setdefault(self.trainable[r.var_index], []).append((actor, p.name, r))
        whole = {i for i, refs in held.items() if len(refs) == refs[0][2].num_shards}
        rest = {i: _nbytes(*spec) for i, spec in enumerate(self.weight_specs) if i not in whole}
        for batch in batches(rest):
            part = self._worker0(batch, {})["weights"]
            for i in batch:
                value = part.pop(i)
                yield i, (self._from_servers(held[i], np.array(value)) if i in held else value)
        for i in sorted(whole):
            if len(held[i]) == 1:   # one shard: the server's array itself, not a copy of it
                (_, name, r), = held[i]
                yield i, self._read_shards(name, held[i])[r.key]
            else:
                yield i, self._from_servers(held[i], np.empty(*self.weight_specs[i]))

    def _from_servers(self, refs: list, value: np.ndarray) -> np.ndarray:
        """``value`` with the shards ``refs`` lists read from their parameter servers."""
        for name in dict.fromkeys(n for _, n, _ in refs):
            mine = [ref for ref in refs if ref[1] == name]
            got = self._read_shards(name, mine)
            for _, _, r in mine:
                value[r.slicer(value.ndim)] = got[r.key]
        return value

    def _read_shards(self, name: str, refs: list) -> dict:
        """Shard key -> value of the shards ``refs`` lists, all on parameter server ``name``."""
        actor = refs[0][0]
        return self._timed(lambda: wait_all([actor.checkpoint_state.remote([], [r.key for _, _, r in refs])],
                                            self.deadline, "parameter server", [name],
                                            actors=self.session.actor_labels())[0])["values"]

    def arrays(self):
        """``(name, array)`` of every optimizer state array (names as in the module doc)."""
        plan, labels = self.session.plan, self.session.actor_labels()
        for actor, p in zip(self.session.ps_actors, plan.ps_actors):
            for batch in batches(self.ps_sizes[p.name]):
                reply = self._timed(lambda: wait_all([actor.checkpoint_state.remote(batch)], self.deadline,
                                                     "parameter server", [p.name], actors=labels)[0])
                yield from ((f"ps/{p.name}/{k}", reply["slots"][k]) for k in batch)
        for c, sizes in enumerate(self.channel_sizes):
            for batch in batches(sizes or {}):
                yield from ((f"channel{c}/{k}", a) for k, a in self._worker0([], {c: batch})["channels"][c].items())
        for w, states in enumerate(self.seeds):
            yield from ((f"seeds/{w}/{i}", a) for i, a in enumerate(states))
        for w, (worker, name) in enumerate(zip(self.session.workers, self.session.plan.replicas)):
            memory = self._timed(lambda: wait_all([worker.compressor_state.remote()], self.deadline, "worker", [name],
                                                  actors=self.session.actor_labels())[0])
            yield from ((f"compressors/{w}/{k}", a) for k, a in memory.items())
        if self.loss_scale is not None:
            yield "loss_scale", np.asarray(self.loss_scale, np.float64)

    def _worker0(self, weights: list, channels: dict) -> dict:
        session = self.session
        return self._timed(lambda: wait_all([session.workers[0].checkpoint_part.remote(weights, channels)],
                                            self.deadline, "worker", [session.plan.replicas[0]],
                                            actors=session.actor_labels())[0])

    def _timed(self, read):
        t0 = time.perf_counter()
        try:
            return read()
        finally:
            self.read_s += time.perf_counter() - t0


def batches(sizes: dict, limit: int | None = None) -> list[list]:
    """The keys of ``sizes`` (key -> bytes) in order, grouped so that a group holds at most
    ``limit`` bytes (``BATCH_BYTES``), or one key bigger than that alone."""
    limit = BATCH_BYTES if limit is None else limit
    out, total = [], 0
    for key, size in sizes.items():
        if not out or total + size > limit:
            out.append([])
            total = 0
        out[-1].append(key)
        total += size
    return out


def snapshot(session: Session, deadline: float | None) -> Snapshot:
    """Read the counters and positions of every actor of ``session`` and the sizes of its arrays
    (``Snapshot`` reads the arrays themselves when asked). Between round trips only.

    Raises:
        TrialFailed: a worker or parameter server failed or died.
    """
    plan, labels = session.plan, session.actor_labels()
    states = wait_all([w.checkpoint_state.remote(i == 0) for i, w in enumerate(session.workers)], deadline,
                      "worker", list(plan.replicas), actors=labels)
    names = [p.name for p in plan.ps_actors]
    ps_states = wait_all([a.checkpoint_state.remote([]) for a in session.ps_actors], deadline, "parameter server",
                         names, actors=labels)
    canonical = {f"ps/{n}/{k}": c for n, s in zip(names, ps_states) for k, c in s["canonical"].items()}
    canonical.update((f"channel{c}/{k}", x) for c, names_c in enumerate(states[0]["canonical"])
                     for k, x in names_c.items())
    return Snapshot(session, deadline, positions=data_parts.part_positions(states), canonical=canonical,
                    ps_versions={n: {"version": s["version"], "chunk_version": s["chunk_version"]}
                                 for n, s in zip(names, ps_states)},
                    weight_specs=states[0]["weights"], trainable=states[0]["trainable"], layout=states[0]["layout"],
                    ps_sizes={n: s["sizes"] for n, s in zip(names, ps_states)}, channel_sizes=states[0]["channels"],
                    seeds=tuple(s["seeds"] for s in states), loss_scale=states[0].get("loss_scale"))


def write_weights(snap: Snapshot, path: str, model) -> None:
    """Write the model weights of ``snap`` to ``path`` (a ``.weights.h5``) as they are read: in the
    layout worker 0 reported, with no Keras model here, or where it reported none with the
    Keras model ``model()`` returns, by its own ``save_weights``."""
    if snap.layout is not None:
        weights_file.write(path, snap.layout, snap.weight_specs, snap.weights())
        return
    keras_model = model()
    every = keras_model.weights
    for i, value in snap.weights():   # a batch at a time: the model is not copied whole
        every[i].assign(value)
    keras_model.save_weights(path)


@contextlib.contextmanager
def saved_weights(session: Session, path: str, deadline: float | None, model, where: str):
    """``(weights, values)`` of the weights file ``path`` for ``load``, read when sent: through
    the layout worker 0 of ``session`` reports (no Keras model here), or where it reports none
    loaded into the Keras model ``model()`` returns, by its own ``load_weights``.

    Raises:
        ConfigError: the file does not hold this model's weights, or cannot be read.
    """
    state = wait_all([session.workers[0].checkpoint_state.remote(True)], deadline, "worker",
                     [session.plan.replicas[0]], actors=session.actor_labels())[0]
    if state["layout"] is None:
        keras_model = model()
        try:
            keras_model.load_weights(path)
        except Exception as e:  # noqa: BLE001 - h5py and Keras raise many kinds
            raise ConfigError(f"{path} cannot be loaded into the model ({type(e).__name__}: {e})",
                              source=where) from None
        yield list(keras_model.weights), list(keras_model.trainable_variables)
        return
    try:
        saved = weights_file.Weights(path, state["layout"], state["weights"])
    except OSError as e:   # not an HDF5 file, or a damaged one
        raise ConfigError(f"{path} cannot be read ({e})", source=where) from None
    with saved:
        if saved.problems:
            raise ConfigError(saved.problems, source=where)
        weights = [saved[i] for i in range(len(state["weights"]))]
        yield weights, [weights[i] for i in state["trainable"]]


def resized_position(position: int, before: int, after: int) -> int:
    """Where each of ``after`` workers goes on in its own part of the data (``dataset_fn(worker,
    after)``) when ``before`` workers drew ``position`` batches each from theirs: past the batches
    all of them drew, ``position * before // after``. Where the parts interleave (worker i of n
    takes every n-th batch or example from i, as ``tf.data.Dataset.shard(n, i)`` does), that is
    exactly the global stream's next batch when ``after`` divides it (2 workers at 3 -> 1 at 6), and
    otherwise repeats less than one batch per worker; no batch is skipped (Horovod's elastic
    sampler likewise goes on with what the workers have not processed)."""
    return position * before // after


def load(session: Session, state: SessionState, values: list, step: int, deadline: float | None,
         canonical: bool = False) -> list[str]:
    """Write ``state`` into the (freshly started) actors of ``session``: the workers' weights and
    each parameter server's values and slots ``BATCH_BYTES`` at a time (``ps_checkpoint``).

    Args:
        state: as read from a checkpoint; its ``weights`` may be arrays, the variables of a
            Keras model holding them or a weights file's datasets (read when sent).
        values: every trainable variable's value (model order; as ``weights``), sliced into the
            PS shards.
        step: the global step the state is at.
        canonical: ``state.arrays`` is a checkpoint of another strategy re-cut for this one
            (``reshard.Recut``): its parameter servers' slots and its channels' state named as
            any holder names them.

    Returns:
        the problems found (the state does not fit these actors); empty on success.

    Raises:
        TrialFailed: a worker or parameter server failed or died.
    """
    import ray

    plan, labels = session.plan, session.actor_labels()
    problems = []
    for actor, p in zip(session.ps_actors, plan.ps_actors):
        counters = state.ps_versions.get(p.name)
        if counters is None:
            problems.append(f"the checkpoint has no state of parameter server {p.name}")
            continue
        prefix = f"ps/{p.name}/"
        reads = [(0, r.key, lambda r=r: _part(values[r.var_index], r.slicer(len(values[r.var_index].shape))))
                 for r in p.shards]
        reads += [(1, k[len(prefix):], lambda k=k: state.arrays[k]) for k in state.arrays if k.startswith(prefix)]
        for part in _read_batches(reads):   # one batch in the driver and the object store at a time
            wait_all([actor.stage_checkpoint.remote(*part)], deadline, "parameter server", [p.name], actors=labels)
            del part
        ref = actor.load_checkpoint.remote({}, {}, counters["version"], counters["chunk_version"], canonical)
        problems += wait_all([ref], deadline, "parameter server", [p.name], actors=labels)[0]
    channels = [state.arrays.channel_state()] if canonical else _channels(state.arrays)
    names = list(plan.replicas)
    for batch in batches({i: _nbytes(w.shape, w.dtype) for i, w in enumerate(state.weights)}):
        part = ray.put({i: _array(state.weights[i]) for i in batch})   # one copy for every worker
        wait_all([w.assign_weights.remote(part) for w in session.workers], deadline, "worker", names, actors=labels)
        del part
    scaling = state.arrays.get("loss_scale")
    scaling = None if scaling is None else [float(x) for x in _array(scaling)]
    # onto another number of workers (``Manifest.mismatches``: every worker drew as many batches),
    # each goes on past the batches all of them drew (``resized_position``); the compressors' memory,
    # each old worker's own, starts afresh, as do the random streams of workers the checkpoint lacks
    # with data parts (``data_parts``), a part's position is its worker's; a worker's parts drew as many
    same = len(state.positions) == session.num_parts
    own = same and not canonical and session.parts is None   # each worker's compressor memory: the same workers
    parts = session.parts or [(i,) for i in range(len(session.workers))]
    if session.parts is not None and not same:
        return [f"the checkpoint holds the data positions of {len(state.positions)} workers, and the workers "
                f"here keep the global batch of {session.num_parts}"]
    if same and any(len({state.positions[p] for p in own_parts}) > 1 for own_parts in parts):
        return [f"the data parts one worker draws from stand at different positions in the checkpoint "
                f"({list(state.positions)[:8]}): a worker holds several only from a synchronous strategy's"]
    position = None if same else resized_position(state.positions[0], len(state.positions), len(session.workers))
    refs = [w.restore_checkpoint.remote(state.positions[parts[i][0]] if same else position, step, channels,
                                        _seeds(state.arrays, i),
                                        scaling, canonical,
                                        _prefixed(state.arrays, f"compressors/{i}/") if own else None)
            for i, w in enumerate(session.workers)]
    for found in wait_all(refs, deadline, "worker", names, actors=labels):
        problems += found
    return problems


def _channels(arrays: Mapping) -> list:
    """Per worker channel, its state in ``arrays`` (``channel<c>/<name>``), or None."""
    used = [int(k.split("/")[0][len("channel"):]) for k in arrays if k.startswith("channel")]
    return [_prefixed(arrays, f"channel{c}/") or None for c in range(max(used, default=-1) + 1)]


def _prefixed(arrays: Mapping, prefix: str) -> dict:
    """The arrays whose names start with ``prefix``, named without it."""
    return {k[len(prefix):]: arrays[k] for k in arrays if k.startswith(prefix)}


def _seeds(arrays: Mapping, worker: int) -> list | None:
    """Worker ``worker``'s random-layer generator states in ``arrays`` (``seeds/<w>/<i>``), in
    order; None where the checkpoint holds none for it (written before they were kept)."""
    prefix = f"seeds/{worker}/"
    found = {int(k[len(prefix):]): k for k in arrays if k.startswith(prefix) and k[len(prefix):].isdigit()}
    if not found:
        return None
    return [arrays[found[i]] if i in found else None for i in range(max(found) + 1)]


def _readable(value):
    """What indexing reads ``value`` from: an array or an HDF5 dataset itself, a Keras variable's value."""
    return value.numpy() if hasattr(value, "numpy") else value


def _array(value) -> np.ndarray:
    """An array, a Keras variable's value, or an HDF5 dataset's (read whole)."""
    return value if isinstance(value, np.ndarray) else np.asarray(_readable(value)[()])


def _read_batches(reads: list):
    """``(values, slots)`` dicts of about ``BATCH_BYTES`` (a bigger array alone), from ``reads``:
    ``(0 for a value or 1 for a slot, its name, a function that reads the array)``, each read
    when its batch is built."""
    batch, total = ({}, {}), 0
    for kind, name, read in reads:
        array = read()
        if total and total + array.nbytes > BATCH_BYTES:
            yield batch
            batch, total = ({}, {}), 0
        batch[kind][name] = array
        total += array.nbytes
    if total or any(batch):
        yield batch


def _part(value, index: tuple) -> np.ndarray:
    """A contiguous copy of ``value[index]`` (see ``_array``): of a dataset, only that part is read.
    (``asarray``: a scalar's part, read by ``()``, stays a 0-d array; ``ascontiguousarray`` makes it 1-d.)"""
    return np.asarray(_readable(value)[index], order="C")


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
