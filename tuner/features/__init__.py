"""Features: pure, vectorised functions of (strategy batch, ModelSpec, ClusterSpec). Per-variable
tables (``tables``), the per-block sums (``sums``) and the feature rows assembled from them
(``batch.featurize``), the alpha-beta step time over those rows (``alpha_beta``), and the
incremental featurizer that updates annealing proposals from their chains' rows (``incremental``,
with ``cell_parts`` and ``group_sums``). The bottom layer: it imports ``strategy_space`` and numpy,
no other tuner package."""
