"""Search: the ``Tuner`` interface (``base``) and its implementations (``baseline_tuner``,
``random_tuner``, ``model_based``), the knowledge sampler (``sampler``), simulated annealing and the
diverse choice of what to measure (``annealing``), the user's pins (``constraints``), the tuning
loop (``tuning``) and the baselines' runs (``baseline_runs``). The top layer: it may import every
other tuner package."""
