"""The strategy space: pure data and logic (no TensorFlow, no Ray).

Specs of models and clusters, the Strategy representation, YAML I/O, validation, the space of
legal choices with sampling, mutation and array encoding, and the baseline builders.
"""
from .compressor import Compressor
from .errors import ConfigError, StrategyError
from .cluster_spec import ClusterSpec, NodeSpec
from .model_spec import ComputeProfile, ModelSpec, VariableSpec
from .strategy import PS, AllReduce, Strategy, VarConfig, shard_bounds
from .validation import validate
from .yaml_io import dumps, load, load_cluster_spec, load_model_spec, load_strategy, loads, save

__all__ = [
    "ConfigError", "StrategyError", "ClusterSpec", "ComputeProfile", "ModelSpec", "NodeSpec",
    "VariableSpec", "PS", "AllReduce", "Strategy", "VarConfig", "Compressor", "shard_bounds",
    "validate", "dumps", "load", "load_cluster_spec", "load_model_spec", "load_strategy", "loads", "save",
]
