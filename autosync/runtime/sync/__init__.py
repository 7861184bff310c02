"""Worker-side synchronization: how a worker's gradients become the next step's values.

- ``base``: the ``SyncChannel`` contract every channel meets, ``shard_gradient``, and the
  ``CollectiveBackend`` contract every collective transport meets.
- ``early_push``: a push issued from inside the worker's step, beside the step's collectives.
- ``ps``: ``PSChannel``, a worker's side of the parameter servers.
- ``allreduce``: ``AllReduceChannel`` (fusion groups reduced eagerly through a backend) and the
  plan records ``ARGroup``/``ARMember``.
- ``graph``: ``GraphAllReduceChannel``, all-reduce and the Keras optimizer inside the training step.
- ``graph_powersgd``: PowerSGD's rounds inside that step (``PowerSGDGraphState``).
- ``backends``: gloo, nccl, object-store and hierarchical backends and their registry.
- ``tf_collective``: TensorFlow's collective ops across Ray actors (the ``graph`` backend's transport).
- ``compression``: fp16, error feedback and PowerSGD on numpy buffers.

Modules import each other in that order only (``base`` first); nothing is re-exported here.
"""
