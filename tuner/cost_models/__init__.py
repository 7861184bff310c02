"""Cost models: what predicts a strategy's step time from its feature rows, and how well. The
``StepTimeModel`` interface (``step_time_model``), the analytic alpha-beta model (``analytic``), the
learned simulator (``simulator``), the ranker (``ranker``), their evaluation (``evaluation``), the
``Predictor`` that judges and fuses them (``predictor``) and the chain scorers the annealer follows
(``scoring``). It may import ``tuner.features``, ``tuner.records`` and ``tuner.synthetic``, never the
search that follows it."""
