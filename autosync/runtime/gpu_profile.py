"""A model's compute profile measured where its workers compute, when that is a GPU.

``tune`` records trials against the model's profiled ModelSpec, and the cost model reads its
compute time. The profile used to be measured in the driver's own process: on a GPU cluster
whose driver runs on a CPU node that is a CPU's step time for workers that step on GPUs; on a
driver whose node has GPUs, TensorFlow there keeps the memory it took on a GPU that a worker of
that node trains on, for the whole run. So where the cluster's first worker slot computes on a
GPU (``ClusterBinding.slot_gpus``), the profile runs as a Ray task on that slot's node with one GPU
and that worker's CPUs, in a process that exits when the task ends (``max_calls=1``) and gives
its GPU memory back. Anywhere else it is measured in this process, as before.
"""
from __future__ import annotations

from strategy_space import ClusterSpec, ModelSpec
from strategy_space.errors import ConfigError

PROFILE_TIMEOUT_S = 900.0   # a large model's build, trace and timed steps, on a node still starting


def _profile_here(model_def, apart: bool = True, workers: int | None = None) -> ModelSpec:
    from autosync.models.profile import profiled_model_spec

    return profiled_model_spec(model_def, apart=apart, digest_workers=workers)


def profiled_spec(model_def, cluster: ClusterSpec, timeout_s: float = PROFILE_TIMEOUT_S) -> ModelSpec:
    """``model_def``'s ModelSpec with its compute profile, measured on a GPU of the cluster where
    its first worker computes on one, else in this process (module doc).

    Raises:
        ConfigError: the model cannot be built or traced (what the profile in this process says),
            or the task could not run on the node (its reason).
    """
    from autosync.runtime.binding import ClusterBinding, slot_gpus

    slot = cluster.devices[0]
    node = slot.rsplit(":", 1)[0]
    if cluster.compute == "emulated" or not slot_gpus(cluster, slot):
        # a large model read apart for it brings its probe key for the cluster's workers along
        return _profile_here(model_def, workers=len(cluster.devices))
    import ray

    binding = ClusterBinding.bind(cluster)
    try:
        options = binding.actor_options(node, binding.worker_cpus(node), 1)
        task = ray.remote(max_calls=1, max_retries=0)(_profile_here).options(**options)
        try:
            return ray.get(task.remote(model_def, False), timeout=timeout_s)   # (a process of its own)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, ConfigError):
                raise e.cause from None
            raise ConfigError(f"measuring model {model_def.name}'s compute on a GPU of node {node} failed: "
                              f"{type(e.cause).__name__}: {str(e.cause).strip()[:300]}") from None
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(f"measuring model {model_def.name}'s compute on a GPU of node {node} took more "
                              f"than {timeout_s:g} s; check that the node's Ray can start a task with a GPU") from None
    finally:
        binding.close()   # (stops an embedded Ray this started; the runner starts its own)
