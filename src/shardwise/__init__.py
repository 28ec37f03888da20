"""shardwise: read and write tensor-parallel PyTorch checkpoints on any accelerator.

>>> import shardwise as sw
>>> backend = sw.init_backend("gloo")                      # doctest: +SKIP
>>> sw.load(model, "ckpt/", plan=plan, mesh=backend.mesh(tp=4))  # doctest: +SKIP
"""

from __future__ import annotations

from shardwise._version import __version__
from shardwise.backends import (
    Backend,
    available_backends,
    current_backend,
    init_backend,
    register_backend,
    shutdown_backend,
)
from shardwise.core.plan import resolve_plan
from shardwise.core.spec import Region, ShardSpec
from shardwise.core.styles import PackedColwise, PackedRowwise
from shardwise.errors import (
    BackendError,
    BackendUnavailableError,
    CheckpointError,
    CollectiveError,
    MeshError,
    NonFiniteError,
    PlanError,
    ShardingError,
    ShardwiseError,
    StorageError,
    UnknownBackendError,
    UnsupportedModelError,
    UsageError,
)
from shardwise.parallel import get_shard_state, parallelize

# The I/O entry points load on first use: `import shardwise` stays light.
_LAZY = {
    "load": "shardwise.io.load",
    "LoadResult": "shardwise.io.load",
    "save": "shardwise.io.save",
    "consolidate": "shardwise.io.consolidate",
    "save_optimizer": "shardwise.io.optim",
    "load_optimizer": "shardwise.io.optim",
    "clip_grad_norm_": "shardwise.clip",
    "verify": "shardwise.io.verify",
    "diff": "shardwise.io.diff",
    "from_pretrained": "shardwise.hf",
    "empty_model": "shardwise.hf",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")

__all__ = [
    "Backend", "BackendError", "BackendUnavailableError", "CheckpointError", "CollectiveError",
    "MeshError", "NonFiniteError", "PackedColwise", "PackedRowwise", "PlanError", "Region", "ShardSpec",
    "ShardingError", "ShardwiseError", "StorageError", "UnknownBackendError", "UnsupportedModelError",
    "UsageError",
    "__version__", "available_backends", "current_backend", "get_shard_state", "init_backend",
    "parallelize", "register_backend", "resolve_plan", "shutdown_backend",
    *_LAZY,
]
