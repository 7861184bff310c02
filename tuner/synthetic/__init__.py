"""Synthetic measurements, so the tuner is tested and benchmarked without hardware: the flow-level
network simulation of one step (``netsim``) and ``SyntheticRunner`` with generated models, clusters
and datasets on top of it (``runner``). It may import ``tuner.features`` and ``tuner.records``,
never the cost models or the search it serves."""
