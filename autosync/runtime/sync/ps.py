"""Parameter-server synchronization seen from one worker (the channel; the shards are
``autosync.runtime.ps_shard``). The channel contract is in ``base``.

Pipelining (``PSChannel`` with ``chunks``, synchronous PS): an actor's keys may be split into a
few chunks of similar bytes (``ps_chunks``); the channel then pushes and pulls each chunk in its
own call, so the PS applies and serves a chunk as soon as all workers pushed it, and a chunk's
pull crosses the network while other chunks' pushes are still in flight: both directions of a NIC
carry traffic at once instead of all pushes, then all pulls. Calls stay batched per chunk (a few
per PS actor and step), never one per variable.
"""
from __future__ import annotations

import numpy as np

from autosync.runtime.psnet import finished, gather
from autosync.runtime.rows import index_dtype, payload_bytes
from autosync.runtime.slices import dedup_aligned_many, dedup_rows
from autosync.runtime.sync.base import SyncChannel, shard_gradient


def ps_chunks(shards, shapes: list, itemsize: list, max_chunks: int, min_bytes: int,
              sparse_bytes: dict | None = None) -> list | None:
    """Split one PS actor's keys into at most ``max_chunks`` chunks of similar bytes, none under
    ``min_bytes`` (so a small actor keeps one call); where the dense shards split, the sparse
    ones (rows move, not the table) form one chunk of their own. None: one chunk (no split).

    With ``sparse_bytes`` (sparse key -> bytes a step moves of it each way; the caller gives it
    where they are worth pipelining) the sparse keys split too, into the chunks the dense ones
    leave (the dense keys then one chunk, where they do not split): an embedding model's step
    then pulls its first tables' rows while the others' pushes are still crossing the link,
    instead of pulling nothing until every table is pushed.

    Args:
        shards: the actor's ``ShardRef`` s, in plan order.
        shapes, itemsize: per model variable, its shape and bytes per element.
    """
    if max_chunks <= 1:
        return None
    dense = [(r.key, r.nbytes(shapes[r.var_index], itemsize[r.var_index])) for r in shards if not r.sparse]
    sparse = [r.key for r in shards if r.sparse]
    total = sum(b for _, b in dense)
    count = min(max_chunks - (1 if sparse else 0), total // max(1, min_bytes))
    chunks = _split(dense, count) if count >= 2 else [[k for k, _ in dense]] if dense else []
    budget = max_chunks - len(chunks)
    if sparse_bytes and budget >= 2 and len(sparse) >= 2:
        chunks += _split([(k, sparse_bytes.get(k, 0)) for k in sparse], min(budget, len(sparse)))
    elif count < 2:
        return None   # nothing splits: one call per actor
    elif sparse:
        chunks.append(sparse)
    return chunks if len(chunks) > 1 else None


def _split(sized: list, count: int) -> list:
    """Keys (with their bytes) in order, cut into at most ``count`` runs of similar bytes."""
    total = sum(b for _, b in sized)
    chunks, current, filled = [], [], 0
    for key, b in sized:
        # a key whose middle lies past the current chunk's share of the total starts the next chunk
        if current and filled + b / 2 > total * (len(chunks) + 1) / count and len(chunks) < count - 1:
            chunks.append(current)
            current = []
        current.append(key)
        filled += b
    return chunks + [current] if current else chunks


# a PS actor's sparse keys split into chunks too where a step's rows of them take this long on the
# slowest link (and cross one): pipelining then saves more than the calls it adds cost
SPARSE_CHUNK_MIN_S = 1e-3


def pipelined_sparse(plan, actor, cluster, shapes: list, itemsize: list) -> dict | None:
    """What ``ps_chunks`` splits ``actor``'s sparse keys by (``sparse_step_bytes``), where that
    pays: the actor serves a worker on another node; its node's link would otherwise carry the
    step's pushes and then its pulls one way at a time (the only PS actor, or one on a node
    without workers: actors on several worker nodes already send and receive at once, each
    serving the others' workers, and more calls only cost); and a step's rows of it take at
    least ``SPARSE_CHUNK_MIN_S`` to cross the cluster's slowest link (each chunk costs a call).
    Measured on the testbed (2 nodes at 200mbit, emulated compute, before and after,
    ``benchmarks/results/ps_testbed_shaping_emulated.json``): one PS actor 9.0 -> 6.9 ms a step
    on ncf-small, 12.9 -> 11.1 on dlrm-small; cut on every actor, ps_lb's actors on both nodes
    went 5.1 -> 8.1 ms (ncf), hence the rule."""
    nodes = {plan.replica_node(slot) for slot in plan.replicas}
    if nodes <= {actor.node} or (len(plan.ps_actors) > 1 and actor.node in nodes):
        return None
    sizes = sparse_step_bytes(actor.shards, plan.rows_per_step, shapes, itemsize)
    link = min(n.bandwidth_gbps for n in cluster.nodes) * 1e9 / 8
    return sizes if sum(sizes.values()) >= link * SPARSE_CHUNK_MIN_S else None


def sparse_step_bytes(shards, rows_per_step: tuple, shapes: list, itemsize: list) -> dict:
    """Sparse key -> the bytes one worker's step moves of that shard each way (its rows' values and
    int64 ids), from the spec's rows per step (rows spread evenly over a partitioned table's
    shards); keys whose rows are not known are left out."""
    out = {}
    for r in shards:
        rows = rows_per_step[r.var_index] if r.sparse and r.var_index < len(rows_per_step) else 0
        if not rows:
            continue
        shape = shapes[r.var_index]
        share = (r.stop - r.start) / shape[r.axis]
        width = int(np.prod(shape[1:], dtype=np.int64)) * itemsize[r.var_index]
        out[r.key] = rows * share * (width + (8 if r.axis == 0 else 8 / share))
    return out


class PSChannel(SyncChannel):
    """Parameter-server synchronization for one worker.

    Args:
        worker_index: this worker's position among the replicas.
        actors: ``[(actor_handle, PSActorPlan), ...]``.
        shapes: shape of every model variable (index -> shape).
        staleness: how many steps this worker may run ahead of the slowest one.
        squares: the PS optimizer needs the squared slices of repeated sparse rows.
        aggregator: the node's ``NodeAggregator`` (None: no other worker on this node, or an
            asynchronous PS); locally replicated shards then go through it, once per node.
        chunks: per actor, its keys split into chunks pushed and pulled by separate calls (the
            actor's own ``chunks``); None or one chunk: one push and one pull call per actor.
        rows_by_reference: (synchronous PS) a push of a row-pulled sparse shard does not name its
            rows: they are the rows this worker pulled for the same step, which the actor keeps
            from that pull (``slices.dedup_aligned``), so each step's row ids cross the network once.
        links: per actor, its ZeroMQ ``psnet.Link`` (the PS data plane), or None where the actor's
            calls go through Ray (``psnet``: locally replicated shards); None: Ray for all.
        keep_slices: the PS optimizer transforms each sparse slice (``optimizers.sparse_form``): a
            sparse gradient is pushed slice by slice, repeated rows not summed (nor laid on the
            rows pulled: ``rows_by_reference`` does not apply to it).
        early: whether the worker may push from inside its step (``pushes_early``; the default).

    Row ids travel in the narrowest integer dtype that numbers the shard's rows (``index_dtype``).
    """

    splits_pull = True
    pushes_early = True   # a push sends (ZeroMQ, Ray calls) and collects the replies in ``finish``
    phase = "ps push"

    def __init__(self, worker_index: int, actors: list, shapes: list, staleness: int,
                 squares: bool = True, aggregator=None, chunks: list | None = None,
                 rows_by_reference: bool = False, links: list | None = None, keep_slices: bool = False,
                 early: bool = True):
        self.worker_index = worker_index
        self.pushes_early = early
        self.actors = actors
        self.links = list(links) if links is not None else [None] * len(actors)
        if len(self.links) != len(actors):
            raise ValueError(f"{len(self.links)} links for {len(actors)} PS actors")
        self.shapes = [tuple(s) for s in shapes]
        self.staleness = staleness
        self.squares = squares
        self.keep_slices = keep_slices
        self.aggregator = aggregator
        if chunks is not None and aggregator is not None and any(c and len(c) > 1 for c in chunks):
            raise ValueError("chunked PS calls do not go through a node aggregator")
        self.chunks = [[tuple(k) for k in c] if c and len(c) > 1 else None for c in (chunks or [None] * len(actors))]
        self.calls = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self._pushes: list = []
        # each shard's first row in its variable (node-aggregated pulls return shard-local rows)
        self._starts = {ref.key: ref.start for _, plan in actors for ref in plan.shards}
        self.carries = frozenset(ref.var_index for _, plan in actors for ref in plan.shards)
        self._dtypes = {ref.key: index_dtype(ref.stop - ref.start)
                        for _, plan in actors for ref in plan.shards if ref.sparse}
        self.rows_by_reference = rows_by_reference
        self._asked: dict[int, dict] = {}  # step -> {key: shard-local rows pulled for it (the actor keeps them)}

    def _via_node(self, ref) -> bool:
        return self.aggregator is not None and ref.local_replication

    def pull(self, step: int, fresh: bool = False, rows: dict | None = None) -> dict:
        return self.finish_pull(self.start_pull(step, fresh, rows))

    def start_pull(self, step: int, fresh: bool = False, rows: dict | None = None) -> tuple:
        """Issue the pull calls of ``step`` (see ``pull``) without waiting: with staleness >= 1 a
        worker issues step t+1's pull before computing step t, so the pull overlaps the step
        (it waits only for updates up to ``t + 1 - staleness``, which needs no push of step t).
        ``finish_pull`` waits for the values."""
        min_version = step if fresh else step - self.staleness
        rows = rows or {}
        # the final, fresh pull of a run is every worker's own (one worker may pull alone)
        node = self.aggregator is not None and not fresh
        refs, wanted, node_rows = [], [], {}
        # rows the actors keep for this step's push (asker): direct row pulls of a synchronous PS
        asker = (self.worker_index, step) if self.rows_by_reference else None
        for a, (actor, plan) in enumerate(self.actors):
            local, shard_rows = {}, {}
            for ref in plan.shards:
                routed = node and ref.local_replication
                if routed:
                    node_rows.setdefault(a, {})
                if ref.sparse and ref.var_index in rows:
                    ids = rows[ref.var_index]
                    if ref.num_shards > 1:
                        ids = ids[(ids >= ref.start) & (ids < ref.stop)]
                    (node_rows[a] if routed else shard_rows)[ref.key] = (ids - ref.start).astype(self._dtypes[ref.key])
                    if not routed:
                        local[ref.key] = ids
                        if asker is not None and len(ids):
                            self._asked.setdefault(step, {})[ref.key] = shard_rows[ref.key]
            self.bytes_sent += payload_bytes(shard_rows)
            if self.chunks[a] is not None:  # no aggregator: one pull per chunk, each served when ready
                for c, keys in enumerate(self.chunks[a]):
                    sub = {k: shard_rows[k] for k in keys if k in shard_rows}
                    refs.append(self._call(a, "pull", min_version, sub or None, "all", c, asker))
                    wanted.append(local)
                continue
            wanted.append(local)
            if not node:
                refs.append(self._call(a, "pull", min_version, shard_rows or None, "all", None, asker))
            elif any(not r.local_replication for r in plan.shards):
                refs.append(self._call(a, "pull", min_version, shard_rows or None, "direct", None, asker))
            else:
                refs.append(None)
        node_ref = None
        if node_rows:
            self.bytes_sent += payload_bytes(node_rows)
            node_ref = self.aggregator.pull.remote(self.worker_index, step, min_version, node_rows)
            self.calls += 1
        self.calls += sum(r is not None for r in refs)
        return refs, wanted, node_ref

    def finish_pull(self, pending: tuple) -> dict:
        """The values of a pull issued by ``start_pull``."""
        import ray

        refs, wanted, node_ref = pending
        replies = gather([r for r in refs if r is not None])
        # earlier pushes are complete once their step's values are out; surface their errors
        self._check_pushes()
        shards: dict = {}
        shared = [r[2] for r in replies if r[2] is not None]
        for (_, direct, _), local in zip(replies, [w for w, r in zip(wanted, refs) if r is not None]):
            self.bytes_received += payload_bytes(direct)
            for key, value in direct.items():
                shards[key] = (local[key], value) if key in local else value
        for part in ray.get(shared) if shared else ():
            self.bytes_received += payload_bytes(part)
            shards.update(part)
        if node_ref is not None:
            starts = self._starts
            for values in ray.get(node_ref).values():
                self.bytes_received += payload_bytes(values)
                for key, value in values.items():
                    # shard-local rows of the node's union back to the variable's row ids
                    shards[key] = (value[0].astype(np.int64) + starts[key], value[1]) if isinstance(value, tuple) else value
        return shards

    def push(self, step: int, grads: list) -> None:
        node_payloads = {}
        asked = self._asked.pop(step, {})
        for old in [s for s in self._asked if s < step]:  # pulls whose step pushed nothing for them
            del self._asked[old]
        aligned, payloads = [], []   # (payload, key, the actor's rows of it, indices, values): laid out in one go
        for _, plan in self.actors:
            payload, node_payload = {}, {}
            for ref in plan.shards:
                g = grads[ref.var_index]
                if g is not None:
                    g = self._shard_grad(ref, g)
                    if ref.sparse and self.keep_slices:
                        g = (np.asarray(g[0]).astype(self._dtypes[ref.key]), g[1])
                    elif ref.sparse and ref.key in asked and not self._via_node(ref):  # the actor holds the rows
                        aligned.append((payload, ref.key, asked[ref.key], g[0], g[1]))
                    elif ref.sparse:
                        g = dedup_rows(g[0], g[1], self.squares, self._dtypes[ref.key])
                    (node_payload if self._via_node(ref) else payload)[ref.key] = g
            payloads.append((payload, node_payload))
        laid = dedup_aligned_many([item[2:] for item in aligned], self.squares)
        for (payload, key, *_), g in zip(aligned, laid):
            payload[key] = g
        for a, ((actor, plan), (payload, node_payload)) in enumerate(zip(self.actors, payloads)):
            if self.aggregator is None:
                kinds = None
            elif any(not r.local_replication for r in plan.shards):
                kinds = ("direct",)
            else:
                kinds = ()
            if any(self._via_node(r) for r in plan.shards):
                node_payloads[a] = node_payload
            if self.chunks[a] is not None:
                self.bytes_sent += payload_bytes(payload)
                for c, keys in enumerate(self.chunks[a]):
                    part = {k: payload[k] for k in keys if k in payload}
                    self._pushes.append(self._call(a, "push", self.worker_index, step, part, 1, None, c))
                    self.calls += 1
            elif kinds != ():
                self.bytes_sent += payload_bytes(payload)
                self._pushes.append(self._call(a, "push", self.worker_index, step, payload, 1, kinds))
                self.calls += 1
        if node_payloads:
            self.bytes_sent += payload_bytes(node_payloads)
            self._pushes.append(self.aggregator.push.remote(self.worker_index, step, node_payloads))
            self.calls += 1

    def push_held(self, step: int, grads: list) -> list:
        """Push as ``push`` does (the actors hold the step until ``release``), then ask each actor
        for its part of the squared norm. A sparse shard's part is summed here, from this worker's
        slices before repeated rows are added up (Keras squares each slice): each actor adds up
        the workers' sums."""
        self.push(step, grads)
        asks = []
        for a, (_, plan) in enumerate(self.actors):
            local = 0.0
            for ref in plan.shards:
                if ref.sparse and grads[ref.var_index] is not None:
                    local += float(np.sum(np.square(self._shard_grad(ref, grads[ref.var_index])[1], dtype=np.float64)))
            asks.append(self._call(a, "clip_norm", self.worker_index, step, local))
        self.calls += len(asks)
        return asks

    def held_sq(self, held: list) -> float:
        return float(sum(gather(held)))

    def release(self, step: int, scale, iteration: int | None = None) -> None:
        """Every worker sends the scale (the same; None: the step is skipped) and the optimizer's
        count of updates: an actor applies on the first and ignores the others, so no worker waits
        for another's."""
        scale = None if scale is None else float(scale)
        for a in range(len(self.actors)):
            self._pushes.append(self._call(a, "clip_scale", step, scale, iteration))
        self.calls += len(self.actors)

    def _call(self, a: int, method: str, *args):
        """One call to actor ``a``: over its data-plane link (a ``psnet.Pending``), else through
        Ray (an ObjectRef); ``psnet.gather`` collects either."""
        link = self.links[a]
        if link is not None:
            return link.call(method, *args)
        return getattr(self.actors[a][0], method).remote(*args)

    def finish(self) -> None:
        pushes, self._pushes = self._pushes, []
        gather(pushes)

    def close(self) -> None:
        for link in self.links:
            if link is not None:
                link.close()

    def _check_pushes(self) -> None:
        if self._pushes:
            done = finished(self._pushes)
            if done:
                gather(done)  # raises the PS's error, if any
                keep = {id(r) for r in done}
                self._pushes = [r for r in self._pushes if id(r) not in keep]

    @staticmethod
    def _shard_grad(ref, g):
        return shard_gradient(g, ref.start, ref.stop, ref.axis, ref.num_shards)  # a view; serialized once
