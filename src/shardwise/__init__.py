"""shardwise: read and write tensor-parallel PyTorch checkpoints on any accelerator.

>>> import shardwise as sw
>>> backend = sw.init_backend("gloo")                      # doctest: +SKIP
>>> sw.load(model, "ckpt/", plan=plan, mesh=backend.mesh(tp=4))  # doctest: +SKIP
"""

from __future__ import annotations

from shardwise.backends import (
    Backend,
    available_backends,
    current_backend,
    init_backend,
    register_backend,
    shutdown_backend,
)
from shardwise.core.plan import PackedColwise, PackedRowwise, resolve_plan
from shardwise.core.spec import Region, ShardSpec
from shardwise.errors import (
    BackendError,
    BackendUnavailableError,
    CheckpointError,
    CollectiveError,
    MeshError,
    PlanError,
    ShardingError,
    ShardwiseError,
    UnknownBackendError,
    UnsupportedModelError,
)
from shardwise.parallel import get_shard_state, parallelize

__version__ = "0.1.0"

__all__ = [
    "Backend", "BackendError", "BackendUnavailableError", "CheckpointError", "CollectiveError",
    "MeshError", "PackedColwise", "PackedRowwise", "PlanError", "Region", "ShardSpec",
    "ShardingError", "ShardwiseError", "UnknownBackendError", "UnsupportedModelError",
    "__version__", "available_backends", "current_backend", "get_shard_state", "init_backend",
    "parallelize", "register_backend", "resolve_plan", "shutdown_backend",
]
