"""The tuner (no TensorFlow, no Ray), in five sub-packages, each importing only those listed before
it (plus ``strategy_space``): ``features`` (a strategy batch's feature rows), ``records`` (trials,
their store and the datasets built from them), ``synthetic`` (simulated measurements), ``cost_models``
(what predicts a strategy's step time, and how well) and ``search`` (the tuners and the loop that
drives them); ``tests/test_layering.py`` holds them to that order."""
