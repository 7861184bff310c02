"""Knowledge-guided candidates: strategies built the way experts build them, with variation.

What is known to work (Parallax, AutoSync's cold start): sparse variables on parameter servers,
partitioned and balanced by bytes per bandwidth; dense variables in fused all-reduce; compression
for large dense tensors when the links are slow; local replication where nodes run several
workers. Each candidate starts from one of these recipes with random options, then gets a few
random mutations, so the set covers the neighbourhood of every recipe.
"""
from __future__ import annotations

import numpy as np

from strategy_space.builders import get_builder
from strategy_space.encoding import COMPRESSOR_ID, KIND_AR, KIND_PS, EncodedStrategies
from strategy_space.space import StrategySpace

MIB = 2**20
SLOW_LINK_GBPS = 10.0       # below this, compressing big dense gradients is worth trying
BIG_DENSE_BYTES = 1 * MIB


class KnowledgeSampler:
    """Samples candidates around expert recipes.

    Args:
        space: the strategy space (model, cluster, legal choices).
        max_mutations: each candidate gets 0..max_mutations random mutations.
    """

    def __init__(self, space: StrategySpace, max_mutations: int = 2):
        self.space = space
        self.max_mutations = max_mutations
        model, cluster = space.model, space.cluster
        self.bytes = np.array([v.bytes for v in model.variables], dtype=np.float64)
        self.sparse = np.array([v.sparse for v in model.variables])
        self.slow = min(n.bandwidth_gbps for n in cluster.nodes) < SLOW_LINK_GBPS
        self.multi = space.offers_node_aggregation
        self._built: EncodedStrategies | None = None   # the builders' recipes, encoded once

    def recipes(self, rng: np.random.Generator) -> EncodedStrategies:
        """One encoded strategy per recipe variant (builders with varied options)."""
        base = self._built_recipes()
        hybrid = self._hybrid_by_size(base.take(np.zeros(3, dtype=int)), rng)
        return EncodedStrategies.concat([base, hybrid])

    def _built_recipes(self) -> EncodedStrategies:
        """The builders' variants, built and encoded on first use (they do not change between
        rounds; variants that build the same strategy are encoded once)."""
        if self._built is not None:
            return self._built
        chunks = [int(c * MIB) for c in (1, 4, 16, 64)]
        variants = [("parallax", {"chunk_bytes": c}) for c in chunks]
        variants += [("parallax", {"chunk_bytes": 16 * MIB, "local_replication": True})] if self.multi else []
        variants += [("all_reduce", {"chunk_bytes": c}) for c in chunks]
        variants += [("partitioned_ps", {"min_partition_bytes": m}) for m in (256 * 1024, MIB, 8 * MIB)]
        variants += [("ps_lb", {}), ("uneven_partitioned_ps", {}), ("partitioned_all_reduce", {})]
        strategies = [get_builder(name, **opts).build(self.space.model, self.space.cluster) for name, opts in variants]
        row_of: dict[str, int] = {}   # strategy fingerprint -> its row among the distinct ones
        distinct = []
        for s in strategies:
            if s.fingerprint not in row_of:
                row_of[s.fingerprint] = len(distinct)
                distinct.append(s)
        rows = np.array([row_of[s.fingerprint] for s in strategies], dtype=np.int64)
        self._built = self.space.encode(distinct).take(rows)
        return self._built

    def _hybrid_by_size(self, parallax: EncodedStrategies, rng) -> EncodedStrategies:
        """Parallax, but dense variables above a size threshold also go to partitioned PS."""
        e = parallax.copy()
        for row, q in enumerate((0.5, 0.8, 0.95)):
            dense = ~self.sparse
            if not dense.any():
                continue
            big = dense & (self.bytes >= np.quantile(self.bytes[dense], q))
            e.kind[row, big] = KIND_PS
            e.shards[row, big] = np.minimum(self.space.num_nodes, self.space.shard_max[big])
            e.dest[row, big] = rng.integers(0, self.space.num_nodes, size=int(big.sum()))
            e.sync[row, big], e.staleness[row, big] = 1, 0  # parallax's PS mode: synchronous
        return self.space.normalize(e)

    def compress_big_dense(self, e: EncodedStrategies, rng) -> EncodedStrategies:
        """On slow links, give big dense all-reduced variables a lossy compressor (half of the rows)."""
        offered = {tuple(int(x) for x in c) for c in self.space.compressor_choices}
        choices = [c for c in [(COMPRESSOR_ID["fp16_ef"], 0)] + [(COMPRESSOR_ID["powersgd_ef"], r) for r in self.space.ranks]
                   if c in offered]
        if not self.slow or not choices:
            return e
        rows = rng.random(len(e)) < 0.5
        pick = np.array(choices)[rng.integers(0, len(choices), size=len(e))]
        target = (e.kind == KIND_AR) & self.space.compressible & (self.bytes >= BIG_DENSE_BYTES) & rows[:, None]
        e.compressor[:] = np.where(target, pick[:, :1], e.compressor)
        e.rank[:] = np.where(target, pick[:, 1:], e.rank)
        return self.space.normalize(e)

    def sample(self, rng: np.random.Generator, n: int) -> EncodedStrategies:
        """``n`` candidates: recipes (all of them first), then mutated copies of random recipes."""
        base = self.recipes(rng)
        if n <= len(base):
            return base.take(np.arange(n))
        extra = base.take(rng.integers(0, len(base), size=n - len(base)))
        extra = self.compress_big_dense(extra, rng)
        mutations = rng.integers(0, self.max_mutations + 1, size=len(extra))
        for k in range(1, self.max_mutations + 1):
            rows = np.nonzero(mutations >= k)[0]
            if len(rows):
                mutated = self.space.mutate_encoded(extra.take(rows), rng)
                for f in extra.field_names():
                    getattr(extra, f)[rows] = getattr(mutated, f)
        return EncodedStrategies.concat([base, extra])
