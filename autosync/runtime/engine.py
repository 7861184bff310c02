"""Driver-side execution: a pool of warm worker actors and the session that runs one plan.

``WorkerPool`` keeps one TensorFlow worker actor per replica slot alive across trials (their
start-up is dominated by importing TensorFlow) and PS actors per node (``ps_pool.PSPool``).
``Session`` resets pool PS actors onto its plan's shards, resets the workers onto them and runs
steps; on any failure or time-out it kills every actor involved so the next session starts clean.
"""
from __future__ import annotations

import os
import time

import numpy as np

from autosync.runtime.binding import ClusterBinding
from autosync.runtime.data_check import check_shards
from autosync.runtime.plan import SyncPlan, segment_for
from autosync.runtime.ps_pool import PSPool
from autosync.runtime.ps_shard import ParameterServerShard
from autosync.runtime.sync.allreduce import AllReduceChannel
from autosync.runtime.sync.backends import ObjectStoreBackend, prepare_hierarchy
from autosync.runtime.sync import early_push
from autosync.runtime.sync.graph import GraphAllReduceChannel, split_groups
from autosync.runtime.sync.ps import PSChannel, pipelined_sparse, ps_chunks
from autosync.runtime.waiting import TrialFailed, TrialTimeout, dead_actor, wait_all  # noqa: F401 (also this module's)
from strategy_space.errors import ConfigError


# synchronous PS pipelining (see ``channels.ps_chunks``): at most this many chunks per PS actor,
# none under PS_CHUNK_MIN_BYTES; AUTOSYNC_PS_CHUNKS=1 turns it off (one push and one pull per actor)
PS_CHUNKS = 4
PS_CHUNK_MIN_BYTES = 1 << 20
# a training worker's load stops its user code this long (or a tenth of what is left, if more)
# before the trial's deadline, so that its error, not the wait's time-out, says what happened
LOAD_MARGIN_S = 5.0


def ps_chunk_limit() -> int:
    """Chunks per PS actor: ``$AUTOSYNC_PS_CHUNKS`` (read per session) or ``PS_CHUNKS``."""
    raw = os.environ.get("AUTOSYNC_PS_CHUNKS", "").strip()
    if not raw:
        return PS_CHUNKS
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"AUTOSYNC_PS_CHUNKS must be a whole number >= 1 (1 turns PS pipelining off), got {raw!r}")
    return int(raw)


def stop_at(deadline: float) -> float:
    """When (``time.time()``) a worker stops the user's code it runs, for a wait that ends at
    ``deadline`` (``time.monotonic()``): a margin earlier (``LOAD_MARGIN_S``, or a tenth of what is
    left), so that its error, which says where the code was, arrives before the wait ends."""
    left = deadline - time.monotonic()
    return time.time() + left - max(LOAD_MARGIN_S, 0.1 * left)


class WorkerPool:
    """Warm TensorFlow worker actors, one per replica slot.

    Workers outlive trials and may switch models (``load`` a different ModelDef reuses the
    process, so TensorFlow is imported once per slot). Several runners or trainers may share one
    pool, one at a time.

    Args:
        binding: where the slots' nodes are.
    """

    def __init__(self, binding: ClusterBinding):
        self.binding = binding
        self.actors: dict[str, object] = {}
        self.loaded: dict[str, object] = {}   # slot -> ModelDef it holds
        self.kinds: dict[str, type] = {}      # slot -> worker class (TensorFlow or emulated compute)
        self.model_def = None
        self.description: dict | None = None
        # the ObjectRef of ``description``: workers (reset) and PS actors read the initial values
        # from it in the object store, one copy per node, instead of a copy per process
        self.description_ref = None
        self.spawn_s = 0.0
        # (backend, slots) -> collective group name; torch.distributed makes one world per
        # process, so a group lives exactly as long as the worker processes it was made with
        self._groups: dict[tuple[str, tuple[str, ...]], str] = {}
        self._joined: set[tuple[str, ...]] = set()   # slots whose workers form a TensorFlow cluster
        self._sessions = 0
        self.ps = PSPool(binding, ParameterServerShard)   # PS actors lent to one session at a time
        self.closed = False

    def close(self) -> None:
        """Kill every worker and PS actor and stop the embedded Ray if this pool's binding started it;
        the pool is then refused to runners and trainers (``shared_or_new``)."""
        self.closed = True
        self.kill_all()
        self.binding.close()

    @classmethod
    def shared_or_new(cls, cluster, pool: "WorkerPool | None" = None) -> "WorkerPool":
        """``pool`` if it is bound to ``cluster``, else a new pool bound to it.

        Raises:
            ConfigError: ``pool`` is bound to another cluster.
        """
        if pool is None:
            return cls(ClusterBinding.bind(cluster))
        if getattr(pool, "closed", False):   # a duck-typed pool (a test's fake) is never closed
            raise ConfigError("this worker pool is closed (its worker_pool block ended); make a new one")
        mine = pool.binding.cluster
        if mine != cluster:   # the same name: another compute mode or other nodes
            other = (f"{cluster.name}" if mine.name != cluster.name else f"{cluster.name} with {cluster.compute} "
                     f"compute" if mine.compute != cluster.compute else f"this {cluster.name}: its nodes differ")
            raise ConfigError(f"the shared worker pool is bound to cluster {mine.name} ({mine.compute} compute), "
                              f"not {other}; use a pool made for this cluster")
        return pool

    def collective_group(self, backend: str, slots: tuple[str, ...]) -> str:
        """Name of the ``backend`` (gloo/nccl) group of the workers of ``slots``.

        Workers whose processes already joined a group of other slots are killed first (their
        torch world cannot change); ``ensure`` starts them again.
        """
        import uuid

        name = self._groups.get((backend, slots))
        if name is None:
            torch_world = backend in ("gloo", "nccl") and any(b in ("gloo", "nccl") for b, _ in self._groups)
            # a TensorFlow cluster is joined before a worker runs any op: only fresh workers can
            if torch_world or (backend == "graph" and self.actors):
                self.kill_all(ps=False)
            name = f"autosync-{backend}-{uuid.uuid4().hex[:8]}"
            self._groups[(backend, slots)] = name
        return name

    def next_instance_base(self) -> int:
        """First TensorFlow collective instance key of a new ``graph`` session (keys of one
        session never meet another's shapes)."""
        from autosync.runtime.sync.tf_collective import SESSION_KEYS

        self._sessions += 1
        return self._sessions * SESSION_KEYS

    def _join_graph(self, slots: tuple[str, ...], deadline: float | None) -> None:
        """Make the (fresh) workers of ``slots`` one TensorFlow cluster for in-graph collectives."""
        workers = [self.actors[s] for s in slots]
        addresses = wait_all([w.collective_address.remote() for w in workers], deadline, "worker", list(slots),
                             alive=lambda: self.binding.lost_note(slot_nodes(slots)))
        wait_all([w.join_collective.remote(i, addresses) for i, w in enumerate(workers)], deadline, "worker",
                 list(slots))
        self._joined.add(slots)

    def ensure(self, model_def, slots: tuple[str, ...], deadline: float | None = None) -> list:
        """Handles for ``slots`` (in order) holding ``model_def``; starts or reloads as needed.

        Raises:
            TrialFailed/TrialTimeout: a worker could not start or load the model.
            ConfigError: workers built different initial weights (model_fn ignores the seed).
        """
        import ray

        from autosync.runtime.emulated import EmulatedWorker, worker_class

        if model_def is not self.model_def:
            self.model_def, self.description, self.description_ref = model_def, None, None
        stale = [s for s in slots if self.loaded.get(s) is not model_def]
        if not stale:
            return [self.actors[s] for s in slots]
        t0 = time.perf_counter()
        kind = worker_class(model_def)
        if any(self.kinds.get(s, kind) is not kind for s in self.actors):
            self.kill_all(ps=False)  # real <-> emulated compute: new processes (and collective groups)
            stale = list(slots)
        cls = ray.remote(kind)
        for slot in stale:
            if slot not in self.actors:
                self.kinds[slot] = kind
                node = slot.rsplit(":", 1)[0]
                cpus = self.binding.worker_cpus(node)
                # a worker computing for real takes its GPU; an emulated one runs no TensorFlow
                gpus = self.binding.slot_gpus(slot) if kind is not EmulatedWorker else 0
                self.actors[slot] = cls.options(**self.binding.actor_options(node, cpus, gpus)).remote(cpus)
        if ("graph", slots) in self._groups and slots not in self._joined:
            try:
                self._join_graph(slots, deadline)
            except TrialFailed:
                self.kill_all()
                raise
        # one worker sends its initial values (the parameter servers start from them); the others
        # send only their digest, so the driver never holds more than one copy of the model
        first = stale[0] if self.description is None else None
        refs = [self._load(self.actors[s], kind, deadline, model_def, slots.index(s), len(slots), s == first)
                for s in stale]
        try:
            loaded = wait_all(refs, deadline, "worker", stale, alive=lambda: self.binding.lost_note(slot_nodes(stale)))
        except TrialFailed:
            self.kill_all()
            raise
        self.spawn_s = time.perf_counter() - t0
        for slot in stale:
            self.loaded[slot] = model_def
        if self.description is None:
            self.description, self.description_ref = loaded[0], refs[0]
        reference = self.description["initial_digest"]
        differ = [s for s, d in zip(stale, loaded) if d["initial_digest"] != reference]
        if differ:
            self.kill_all()
            raise ConfigError(f"model {model_def.name}: workers {differ} built different initial weights "
                              f"from seed {model_def.seed}; make model_fn deterministic under "
                              f"keras.utils.set_random_seed (no other RNG, no data-dependent init)")
        if len(stale) == len(slots):   # all loaded together: compare what each drew first
            check_shards(model_def.name, list(slots), [d.get("batch_digest") for d in loaded])
        return [self.actors[s] for s in slots]

    @staticmethod
    def _load(actor, kind, deadline: float | None, *args):
        """A worker's ``load``; a training worker's within what is left of ``deadline``, less a
        margin (``TrainingWorker.load_within``): its error arrives before the wait on it ends. The
        worker is told when to stop on the wall clock (nodes' clocks agree to well within the
        margin where NTP runs; one far ahead stops a slow load early, saying so)."""
        if deadline is None or not hasattr(kind, "load_within"):   # an emulated worker runs no user code
            return actor.load.remote(*args)
        # on the wall clock: the worker starts its load only once its process is up
        return actor.load_within.remote(stop_at(deadline), *args)

    def kill(self, slots) -> None:
        """Kill the workers of ``slots`` (``ensure`` starts them again), and the other members of a
        gloo or nccl group they belonged to; collective groups they belonged to are forgotten, so a
        session that needs one forms it anew."""
        import ray

        slots = set(slots)
        # the others of a gloo or nccl group hold its torch world, which cannot change: they go too
        slots |= {s for (backend, members) in self._groups if backend in ("gloo", "nccl") and slots & set(members)
                  for s in members}
        for slot in slots:
            actor = self.actors.pop(slot, None)
            if actor is not None:
                ray.kill(actor, no_restart=True)
            self.loaded.pop(slot, None)
            self.kinds.pop(slot, None)
        self._groups = {k: v for k, v in self._groups.items() if not slots & set(k[1])}
        self._joined = {j for j in self._joined if not slots & set(j)}

    def kill_all(self, ps: bool = True) -> None:
        """Kill every worker (started again on the next ``ensure``) and, if ``ps``, the pool's PS actors."""
        import ray

        if ps:
            self.ps.kill_all()
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        self.actors, self.loaded, self.kinds = {}, {}, {}
        self._groups = {}
        self._joined = set()


class Session:
    """One plan running on the pool's workers and parameter servers (reset for it).

    Args:
        pool: warm workers holding the model (see ``WorkerPool.ensure``).
        plan: what to run.
        parts: per worker (replica order), the data parts it draws each step's batches from
            (``data_parts``: the global batch of more workers kept); None: one part each, its own.
    """

    def __init__(self, pool: WorkerPool, plan: SyncPlan, parts: list | None = None):
        self.pool = pool
        self.plan = plan
        self.parts = parts
        self.ps_actors: list = []
        self.helpers: list = []   # e.g. the object-store backend's mailbox
        self.workers: list = []
        self.failed = False   # a call of the session failed: its PS actors are never reused

    @property
    def num_parts(self) -> int:
        """How many parts the data is cut into: one per worker, or as many as ``parts`` holds."""
        return len(self.workers) if self.parts is None else sum(len(p) for p in self.parts)

    def check_parts(self) -> None:
        """Raises ConfigError where this plan's workers cannot draw the batches of several data parts
        (``data_parts``): all-reduce groups reduced inside the training step."""
        if split_groups(list(self.plan.ar_groups), list(self.plan.layout))[0]:
            raise ConfigError("the global batch of more workers is kept only where every gradient leaves the "
                              "worker's step (its batches' gradients summed there): this strategy reduces "
                              "all-reduce groups inside the training step (backend graph, or auto on GPUs); "
                              "use another backend (gloo, objectstore), or keep_global_batch=False")

    def start(self, deadline: float | None = None) -> dict:
        """Create the PS actors with the initial values and point every worker at them. Returns the
        placement facts: ``{"ps": [{name, node_id, pid}], "workers": [{node_id, pid, ...}]}``."""
        from autosync.runtime.keras_optimizer import check_global_clipnorm, check_keras_apply
        from autosync.runtime.optimizers import check_optimizer_config, numpy_rules, sparse_form, squares_slices

        plan = self.plan
        if self.parts is not None:
            self.check_parts()
        # graph first: forming its cluster may restart the workers, which ends their gloo world
        setups = {b: self.pool.collective_group(b, plan.replicas)
                  for b in sorted(plan.backends, key=lambda b: b != "graph") if b not in ("objectstore", "hierarchical")}
        if "graph" in setups:
            setups["graph"] = {"group": setups["graph"], "base": self.pool.next_instance_base()}
        if self.pool.description is not None:   # the model is known: its PS actors may import Keras meanwhile
            self.pool.ps.prepare([p.node for p in plan.ps_actors], not numpy_rules(self.pool.description["optimizer"]))
        self.workers = self.pool.ensure(self.pool.model_def, plan.replicas, deadline)
        desc = self.pool.description
        check_optimizer_config(desc["optimizer"])
        graph_groups, numpy_groups = split_groups(list(plan.ar_groups), list(plan.layout))
        outside = [r for p in plan.ps_actors for r in p.shards] + [m for g in numpy_groups for m in g.members]
        check_global_clipnorm(desc["optimizer"], plan, bool(graph_groups) and bool(outside))
        # before any PS starts: what updates outside the graph cannot honour (a constraint, clipnorm on shards)
        check_keras_apply(desc["optimizer"], outside, [v["name"] for v in desc["variables"]])
        binding = self.pool.binding
        shapes = [v["shape"] for v in desc["variables"]]
        # pipelined push/pull chunks: synchronous PS without node aggregation only
        ema = desc["optimizer"].get("use_ema")   # Keras averages all its variables at each apply: one per step
        limit = ps_chunk_limit() if plan.sync and not (plan.node_aggregation() or ema) else 1
        itemsize = [np.dtype(v["dtype"]).itemsize for v in desc["variables"]]
        plan = self.plan = segment_for(plan, desc, [m for g in numpy_groups for m in g.members], shapes, itemsize,
                                       limit, PS_CHUNK_MIN_BYTES)
        self.chunks = [ps_chunks(p.shards, shapes, itemsize, limit, PS_CHUNK_MIN_BYTES,
                                 pipelined_sparse(plan, p, binding.cluster, shapes, itemsize)) for p in plan.ps_actors]
        self.ps_actors, ready = self.pool.ps.start(plan, desc["optimizer"], self.chunks, self.pool.description_ref)
        ps_info = wait_all(ready, deadline, "parameter server", [p.name for p in plan.ps_actors], self.actor_labels(),
                           alive=lambda: binding.lost_note({p.node for p in plan.ps_actors}))
        pairs = list(zip(self.ps_actors, self.plan.ps_actors))
        links = self._start_links(deadline)
        n = self.plan.num_workers
        if "objectstore" in plan.backends:
            mailbox = ObjectStoreBackend.prepare(n, "", binding.actor_options(binding.cluster.chief.name))
            self.helpers.append(mailbox)
            setups["objectstore"] = mailbox
        if "hierarchical" in plan.backends:
            hierarchy = prepare_hierarchy([plan.replica_node(s) for s in plan.replicas], binding.actor_options)
            self.helpers.extend(hierarchy.pop("mailboxes"))
            setups["hierarchical"] = hierarchy
        # members reduced in the graph are updated there; the numpy channel holds only the others
        in_graph, ar_groups = split_groups(list(plan.ar_groups), list(plan.layout))
        squares, slices = squares_slices(desc["optimizer"]), sparse_form(desc["optimizer"]) == "slices"
        aggregators = self._start_aggregators(squares, slices)
        node_of = {i: node for node, workers in plan.node_aggregation().items() for i in workers}

        early = early_push.wanted()

        def channels(i: int) -> list:
            out = [PSChannel(i, pairs, shapes, plan.staleness, squares, aggregators.get(node_of.get(i)),
                             self.chunks, rows_by_reference=plan.sync and not slices, links=links,
                             keep_slices=slices, early=early)] if pairs else []
            if ar_groups:  # after the PS channel: its pushes fly while the collectives run
                # its initial values: each worker reads them from its node's copy of the description
                out.append(AllReduceChannel(i, n, ar_groups, setups, self.pool.description_ref, desc["optimizer"],
                                            seed=self.pool.model_def.seed))
            if in_graph:
                out.append(GraphAllReduceChannel(i, n, in_graph, setups["graph"], seed=self.pool.model_def.seed))
            return out

        # (as a keyword, only where set: an emulated worker takes none)
        parts = [{}] * n if self.parts is None else [{"parts": (p, self.num_parts)} for p in self.parts]
        resets = [w.reset.remote(i, n, channels(i), list(plan.layout), self.pool.description_ref, **parts[i])
                  for i, w in enumerate(self.workers)]
        wait_all(resets, deadline, "worker", list(self.plan.replicas))
        infos = wait_all([w.info.remote() for w in self.workers], deadline, "worker", list(self.plan.replicas))
        return {"ps": ps_info, "workers": infos}

    def _start_links(self, deadline: float | None) -> list:
        """Per PS actor, the data-plane link its workers push and pull through (``psnet``), or
        None where its calls stay on Ray: the ``ray`` transport, or an actor holding locally
        replicated shards (their pull hands out an object shared through a node's store)."""
        from autosync.runtime import psnet

        names = [p.name for p in self.plan.ps_actors]
        served = [i for i, p in enumerate(self.plan.ps_actors)
                  if psnet.transport() == "zmq" and not any(r.local_replication for r in p.shards)]
        endpoints = wait_all([self.ps_actors[i].listen.remote() for i in served], deadline, "parameter server",
                             [names[i] for i in served])
        links: list = [None] * len(self.ps_actors)
        for i, endpoint in zip(served, endpoints):
            links[i] = psnet.Link(endpoint, self.ps_actors[i])
        return links

    def _start_aggregators(self, squares: bool, slices: bool) -> dict:
        """One NodeAggregator per node whose workers aggregate (see ``SyncPlan.node_aggregation``)."""
        import ray

        from autosync.runtime.aggregator import NodeAggregator

        sparse = [r.key for p in self.plan.ps_actors for r in p.shards if r.sparse]
        out = {}
        for node, workers in self.plan.node_aggregation().items():
            actor = ray.remote(NodeAggregator).options(**self.pool.binding.actor_options(node), max_concurrency=1000)
            out[node] = actor.remote(node, len(workers), self.ps_actors, sparse, squares, slices)
            self.helpers.append(out[node])
        return out

    def run(self, steps: int, deadline: float | None = None) -> list[dict]:
        """Run ``steps`` steps on every worker; per-worker results (see ``TrainingWorker.run``). Given
        a ``deadline``, a training worker's data draws stop short of it (``run_within``): a
        ``dataset_fn`` that hangs times out saying where."""
        within = deadline is not None and all(hasattr(self.pool.kinds.get(s), "run_within") for s in self.plan.replicas)
        refs = [w.run_within.remote(stop_at(deadline), steps) if within else w.run.remote(steps) for w in self.workers]
        try:
            return wait_all(refs, deadline, "worker", list(self.plan.replicas), actors=self.actor_labels())
        except BaseException:
            self.failed = True
            raise

    def actor_labels(self) -> dict[str, str]:
        """Actor id hex -> what it is, for naming the one that died."""
        out = {a._actor_id.hex(): f"parameter server {p.name}" for a, p in zip(self.ps_actors, self.plan.ps_actors)}
        out.update({w._actor_id.hex(): f"worker {slot}" for w, slot in zip(self.workers, self.plan.replicas)})
        return out

    def ps_stats(self, deadline: float | None = None) -> dict:
        """Per PS actor (by name): pushes and pulls served, seconds applying updates, and
        ``wait_s``, the time steps spent between their first and last push (how long a shard held
        its update waiting for the slowest sender), summed over the steps run so far."""
        names = [p.name for p in self.plan.ps_actors]
        stats = wait_all([a.stats.remote() for a in self.ps_actors], deadline, "parameter server", names)
        return dict(zip(names, stats))

    def weights(self, deadline: float | None = None) -> list:
        """Model weights of the first worker (synchronized by the last ``run``)."""
        return wait_all([self.workers[0].get_weights.remote()], deadline, "worker")[0]

    def close(self, clean: bool = False) -> None:
        """End it (workers stay warm): PS actors back to the pool if ``clean`` and not ``failed``, else killed."""
        import ray

        for actor in self.helpers:
            ray.kill(actor, no_restart=True)
        (self.pool.ps.give_back if clean and not self.failed else self.pool.ps.kill)(self.ps_actors)
        self.ps_actors, self.helpers = [], []

    def abort(self) -> None:
        """Kill everything this session touched: PS actors and every pool worker."""
        self.close()
        self.pool.kill_all()
        self.workers = []


def slot_nodes(slots) -> set[str]:
    """The nodes of worker slots (``node:i``)."""
    return {s.rsplit(":", 1)[0] for s in slots}
