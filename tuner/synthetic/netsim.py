"""A flow-level discrete-event simulation of one training step: the synthetic world's truth.

It deliberately contains effects the learned models and the analytic formula do not: flows share
each NIC direction by max-min fairness as they come and go (not a sum of bytes over the step),
a parameter server serves push calls one at a time in arrival order (fan-in queue) before it
updates and answers pulls, each node's compute jitters and some nodes straggle, messages pay
serialization and per-call latency, collectives run one after another in ready order as ring
steps (hierarchical ones among node leaders after a reduce on the node) and then each worker
updates its copy of the all-reduced variables (whole tables too), workers with local
replication sum on their node and push once, PowerSGD does two all-reduces plus its matrix
products, fp16 pays the cast, and the
backward pass's cost per variable is not proportional to its size. Only plain data goes in
(ModelSpec, ClusterSpec, Strategy), so it does not share code with ``features``.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from strategy_space import ClusterSpec, ModelSpec, Strategy
from strategy_space.builders import index_bytes, ready_order, step_bytes
from strategy_space.compressor import Compressor, powersgd_compressible, shard_matrix_dims
from strategy_space.strategy import PS, shard_bounds


@dataclass(frozen=True)
class Truth:
    """Hidden constants of the synthetic world (seconds, bytes/s, flop/s)."""

    alpha_call_s: float = 0.65e-3
    alpha_server_s: float = 0.25e-3
    alpha_ring_step_s: float = 0.12e-3
    alpha_objectstore_step_s: float = 0.7e-3
    tcp_efficiency: float = 0.93
    objectstore_efficiency: float = 0.8
    intra_gbps: float = 24.0
    serialize_bps: float = 2.5e9
    server_agg_bps: float = 3e9
    update_bps: float = 6e9
    update_passes: float = 4.0   # a worker's local update of an all-reduced variable (Adam: 2 moments)
    fp16_cast_bps: float = 4e9
    psgd_flops: float = 8e9
    psgd_matrix_s: float = 0.8e-3   # a worker's fixed time per PowerSGD matrix (its dozen small kernels)
    node_jitter: float = 0.04
    straggler_p: float = 0.05
    straggler_x: float = 1.3
    step_noise: float = 0.03


class _Fluid:
    """Flows over capacitated resources with weighted max-min fair rates; flows may be released
    later and completion callbacks may release new flows."""

    def __init__(self, caps: np.ndarray):
        self.caps = caps
        self.now = 0.0
        self.pending: list = []
        self.active: list = []   # [remaining, resources, weight, callback]
        self._seq = 0

    def add(self, at: float, nbytes: float, resources: tuple, weight: float, done) -> None:
        self._seq += 1
        heapq.heappush(self.pending, (at, self._seq, nbytes, resources, weight, done))

    def _rates(self) -> np.ndarray:
        F, R = len(self.active), len(self.caps)
        A = np.zeros((F, R))
        for i, f in enumerate(self.active):
            A[i, list(f[1])] = 1.0
        w = np.array([f[2] for f in self.active])
        rate = np.zeros(F)
        free = np.ones(F, dtype=bool)
        cap = self.caps.astype(float).copy()
        while free.any():
            load = (w * free) @ A
            share = np.full(len(cap), np.inf)
            np.divide(cap, load, out=share, where=load > 0)
            r = int(np.argmin(share))
            if not np.isfinite(share[r]):
                break
            hit = free & (A[:, r] > 0)
            rate[hit] = share[r] * w[hit]
            cap -= rate[hit] @ A[hit]
            cap = np.maximum(cap, 0.0)
            free &= ~hit
        return rate

    def run(self) -> float:
        while self.pending or self.active:
            while self.pending and self.pending[0][0] <= self.now + 1e-15:
                at, _, nbytes, res, w, done = heapq.heappop(self.pending)
                if nbytes <= 0 or not res:
                    done(self.now)
                else:
                    self.active.append([nbytes, res, w, done])
            if not self.active:
                if self.pending:
                    self.now = self.pending[0][0]
                continue
            rate = self._rates()
            with np.errstate(divide="ignore"):
                left = np.array([f[0] for f in self.active]) / rate
            dt = float(left.min())
            if self.pending:
                dt = min(dt, self.pending[0][0] - self.now)
            self.now += dt
            finished = []
            for f, r in zip(self.active, rate):
                f[0] -= r * dt
                if f[0] <= 1e-6 * max(1.0, r * 1e-6):
                    finished.append(f)
            self.active = [f for f in self.active if f not in finished]
            for f in finished:
                f[3](self.now)
        return self.now


def _backward_profile(model: ModelSpec) -> dict:
    """Ready time / compute time per variable: forward 30 %, then backward work per variable
    ~ params^0.8 plus a fixed per-op cost (unlike the features' proportional assumption)."""
    order = ready_order(model)
    work = np.array([model.var(n).size ** 0.8 + 2e3 for n in order])
    ready = 0.3 + 0.7 * np.cumsum(work) / work.sum()
    return dict(zip(order, ready))


def powersgd_matrix(shape: tuple[int, ...], axis: int, slices: int, codec: Compressor) -> tuple[int, int] | None:
    """The ``(m, n)`` matrix PowerSGD sends in low rank for a shard of ``slices`` slices along
    ``axis`` of a variable of ``shape`` (the runtime's ``(first dimension, rest)`` of the shard),
    or None where the shard travels whole (another compressor, or nothing to gain)."""
    if codec.kind != "powersgd":
        return None
    dim = shape[axis] if shape else 1
    size = int(np.prod(shape, dtype=np.int64)) if shape else 1
    m, n = (int(x) for x in shard_matrix_dims(slices, size // dim, shape[0] if shape else 1, axis == 0))
    return (m, n) if powersgd_compressible(m, n, codec.rank) else None


def simulate_step(model: ModelSpec, cluster: ClusterSpec, strategy: Strategy, compute_s: float,
                  rng: np.random.Generator, truth: Truth = Truth()) -> tuple[float, dict]:
    """Seconds of one synchronous step of ``strategy`` (steady state) and a phase breakdown."""
    net = _Network.of(cluster, truth, compute_s, rng)
    servers, buffers, gathers, ar_whole = _strategy_work(model, cluster, strategy)
    ps_end = _schedule_parameter_servers(net, servers, truth)
    ar_end = _schedule_collectives(net, _collectives(net, buffers, gathers, truth), truth)
    net.fluid.run()

    # ---- steady state: staleness lets PS waiting hide behind the next steps -------------------
    stale = max((s.staleness for s in servers.values()), default=0)
    asyn = any(s.asynchronous for s in servers.values())
    end_c = float(net.comp_end.max())
    ps_wait = max(ps_end[0] - end_c, 0.0)
    hide = 0.0 if asyn else 1.0 / (1.0 + stale) ** 1.5
    busy = max(ps_end[0] - float(net.comp_end.min()), 0.0) * (1.0 - hide) * 0.8
    ar_update = truth.update_passes * ar_whole / truth.update_bps
    step = max(end_c + ps_wait * hide, ar_end[0] + ar_update, busy)
    return step, {"compute": end_c, "ps_wait": ps_wait * hide, "all_reduce_end": ar_end[0]}


@dataclass
class _Network:
    """The cluster as the simulation sees it: the fluid over its resources (per node: NIC out, NIC
    in, memory), its workers, and when each node's compute ends this step."""

    fluid: _Fluid
    N: int
    workers: list[int]      # per node
    hosts: list[int]        # nodes with workers
    intra: float            # intra-node bytes/s
    comp_end: np.ndarray    # per node (workers of a node share its jitter)

    @classmethod
    def of(cls, cluster: ClusterSpec, truth: Truth, compute_s: float, rng: np.random.Generator) -> "_Network":
        N = len(cluster.nodes)
        wk = [n.workers or 0 for n in cluster.nodes]
        bw = np.array([n.bandwidth_gbps * 1e9 / 8 for n in cluster.nodes])
        intra = (cluster.intra_node_bandwidth_gbps or truth.intra_gbps) * 1e9 / 8
        fluid = _Fluid(np.concatenate([bw * truth.tcp_efficiency, bw * truth.tcp_efficiency, np.full(N, intra)]))
        jit = np.exp(rng.normal(0, truth.node_jitter, N)) * np.where(rng.random(N) < truth.straggler_p,
                                                                      truth.straggler_x, 1.0)
        return cls(fluid, N, wk, [i for i in range(N) if wk[i]], intra, compute_s * jit)

    @property
    def W(self) -> int:
        return sum(self.workers)

    def nic_out(self, n: int) -> int:
        return n

    def nic_in(self, n: int) -> int:
        return self.N + n

    def memory(self, n: int) -> int:
        return 2 * self.N + n

    def path(self, a: int, b: int) -> tuple[int, ...]:
        """Resources a message from node ``a`` to node ``b`` crosses."""
        return (self.memory(a),) if a == b else (self.nic_out(a), self.nic_in(b))


@dataclass
class _ServerWork:
    """What one parameter-server node serves per step."""

    push: float = 0.0        # bytes each worker pushes
    pull: float = 0.0        # bytes each worker pulls
    lr: float = 0.0          # bytes of locally replicated variables (pushed and pulled once per node)
    last_ready: float = 0.0  # ready time / compute time of its last variable
    staleness: int = 0
    asynchronous: bool = False


def _strategy_work(model: ModelSpec, cluster: ClusterSpec, strategy: Strategy):
    """The strategy's work: per server node (``_ServerWork``), per all-reduce buffer (group,
    backend, compressor, hierarchy) -> [bytes, ready, PowerSGD matrices], the all-gathers
    (bytes, ready), and the bytes of the all-reduced variables each worker updates (whole)."""
    ready = _backward_profile(model)
    index = {n: i for i, n in enumerate(cluster.node_names)}
    srv: dict[int, _ServerWork] = {}
    bufs: dict = {}
    gathers = []
    ar_whole = 0.0
    for cfg in strategy.variables:
        v = model.var(cfg.name)
        vals = step_bytes(v)
        idx = (min(v.rows_per_step or v.shape[0], v.shape[0]) * index_bytes(v.shape[0])) if v.sparse else 0
        dim = v.shape[cfg.axis] if v.shape else 1
        for (lo, hi), s in zip(shard_bounds(dim, cfg.num_shards), cfg.synchronizers):
            frac = (hi - lo) / dim
            if isinstance(s, PS):
                e = srv.setdefault(index[s.destination], _ServerWork())
                if s.local_replication and not v.sparse:   # the node's workers sum, push once, pull once
                    e.lr += vals * frac
                else:
                    e.push += (vals + idx) * frac
                    e.pull += vals * frac
                e.last_ready = max(e.last_ready, ready[v.name])
                e.staleness, e.asynchronous = max(e.staleness, s.staleness), e.asynchronous or not s.sync
            elif v.sparse:
                gathers.append(((vals + idx) * frac, ready[v.name]))
                ar_whole += v.bytes * frac
            else:
                ar_whole += v.bytes * frac
                codec = s.codec
                b = bufs.setdefault((s.group, s.backend, codec, s.hierarchical), [0.0, 0.0, []])
                b[1] = max(b[1], ready[v.name])
                low_rank = powersgd_matrix(v.shape, cfg.axis, hi - lo, codec)
                if low_rank is not None:
                    b[2].append(low_rank + (codec.rank, v.bytes // v.size))
                else:
                    b[0] += vals * frac * (0.5 if codec.kind == "fp16" and v.bytes // v.size == 4 else 1.0)
    return srv, bufs, gathers, ar_whole


def _schedule_parameter_servers(net: _Network, srv: dict[int, _ServerWork], truth: Truth) -> list[float]:
    """Push -> FIFO fan-in -> update -> pull, as flows on the fluid; returns a one-item list the
    flows set to when the last pull arrives (once the fluid runs)."""
    fluid, wk, hosts, W = net.fluid, net.workers, net.hosts, net.W
    t_ps = [0.0]
    state = {n: {"free": 0.0, "got": 0} for n in srv}
    # pushes a server waits for: one per worker of its per-worker bytes, one per node of LR bytes
    expect = {n: (W if e.push else 0) + (len(hosts) if e.lr else 0) for n, e in srv.items()}

    def pulled(t):
        t_ps[0] = max(t_ps[0], t)

    def make_push_done(n, bytes_):
        def done(t):
            st = state[n]
            st["free"] = max(st["free"], t) + truth.alpha_server_s + bytes_ / truth.server_agg_bps
            st["got"] += 1
            if st["got"] == expect[n]:
                go = st["free"] + (srv[n].pull + srv[n].lr) / truth.update_bps + truth.alpha_call_s / 2
                for m in hosts:
                    fluid.add(go, srv[n].pull * wk[m], net.path(n, m), wk[m], pulled)
                    lr = srv[n].lr
                    if lr:
                        fluid.add(go, lr, net.path(n, m), 1.0,
                                  lambda t, m=m, lr=lr: fluid.add(t, lr * wk[m], (net.memory(m),), 1.0, pulled))
        return done

    for n, e in srv.items():
        push, lr, last = e.push, e.lr, e.last_ready
        for m in hosts:
            if push:
                at = net.comp_end[m] * last + push / truth.serialize_bps + truth.alpha_call_s / 2
                # the node's workers push together: weight = number of flows (per-flow fairness)
                cb = make_push_done(n, push)
                fluid.add(at, push * wk[m], net.path(m, n), wk[m], lambda t, cb=cb, k=wk[m]: [cb(t) for _ in range(k)])
            if lr:   # the workers' gradients summed through the node's memory, then one push
                at = net.comp_end[m] * last + lr * wk[m] / truth.serialize_bps + truth.alpha_call_s / 2
                fluid.add(at, lr, net.path(m, n), 1.0, make_push_done(n, lr))
    return t_ps


def _collectives(net: _Network, bufs: dict, gathers: list, truth: Truth) -> list[tuple]:
    """The collectives, in ready order: (ready, seconds before the ring, bytes on the ring, ring
    steps, through the object store)."""
    W, wk, Nw = net.W, net.workers, len(net.hosts)
    most = max(wk)
    colls = []
    for (group, backend, comp, hier), (nbytes, rdy, psgd) in bufs.items():
        os_ = backend == "objectstore"
        cast = nbytes / truth.fp16_cast_bps if comp.kind == "fp16" else 0.0
        # hierarchical: reduce onto node leaders and broadcast back through memory, ring among leaders
        if hier:
            ring, steps, local = 2 * (Nw - 1) / Nw, 2 * (Nw - 1) + 2 * (most > 1), 2 * (most - 1) / net.intra
        else:
            ring, steps, local = 2 * (W - 1) / W, 2 * (W - 1), 0.0
        if nbytes:
            colls.append((rdy, cast + local * nbytes, ring * nbytes, steps, os_))
        if psgd:
            flops = sum(4.0 * m * n * r for m, n, r, _ in psgd) / truth.psgd_flops + truth.psgd_matrix_s * len(psgd)
            pb = sum(r * m * e for m, n, r, e in psgd)
            qb = sum(r * n * e for m, n, r, e in psgd)
            colls.append((rdy, flops / 2 + local * pb, ring * pb, steps, os_))
            colls.append((rdy, flops / 2 + local * qb, ring * qb, steps, os_))
    for nbytes, rdy in gathers:
        colls.append((rdy, 0.0, (W - 1) * nbytes, W - 1, False))
    colls.sort(key=lambda c: c[0])
    return colls


def _schedule_collectives(net: _Network, colls: list[tuple], truth: Truth) -> list[float]:
    """Collectives one at a time in ready order, as ring steps on the fluid; returns a one-item
    list set to when the last one ends (once the fluid runs)."""
    hosts, wk, W = net.hosts, net.workers, net.W
    ring_path = tuple(r for i, a in enumerate(hosts)
                      for r in (net.nic_out(a), net.nic_in(hosts[(i + 1) % len(hosts)]))) if len(hosts) > 1 else ()
    ring_path += tuple(net.memory(a) for a in hosts if wk[a] > 1 or len(hosts) == 1)
    slowest = float(net.comp_end[hosts].max())
    t_ar = [slowest if colls else 0.0]

    def start_coll(i, t):
        if i == len(colls):
            t_ar[0] = t
            return
        rdy, pre, nbytes, steps, os_ = colls[i]
        alpha = truth.alpha_objectstore_step_s if os_ else truth.alpha_ring_step_s
        eff = truth.objectstore_efficiency if os_ else 1.0
        at = max(t, slowest * rdy) + pre + steps * alpha
        net.fluid.add(at, nbytes / eff if W > 1 else 0.0, ring_path, 1.0, lambda t2: start_coll(i + 1, t2))

    if colls:
        start_coll(0, 0.0)
    return t_ar
