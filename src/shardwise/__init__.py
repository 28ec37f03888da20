"""shardwise: read and write tensor-parallel PyTorch checkpoints on any accelerator.

>>> import shardwise as sw
>>> backend = sw.init_backend("gloo")                      # doctest: +SKIP
>>> sw.load(model, "ckpt/", plan=plan, mesh=backend.mesh(tp=4))  # doctest: +SKIP

The public names are ``__all__`` (the I/O entry points import on first use); every error is
in :mod:`shardwise.errors`, the base class and the ones callers catch most also here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise import errors as errors  # the namespace of every error: sw.errors.StorageError
from shardwise._version import __version__
from shardwise.errors import CheckpointError, CollectiveError, PlanError, ShardwiseError, UsageError

if TYPE_CHECKING:  # what type checkers see for the names below, which load on first use
    from shardwise.adapters import save_adapter as save_adapter
    from shardwise.backends import Backend as Backend
    from shardwise.backends import init_backend as init_backend
    from shardwise.backends import shutdown_backend as shutdown_backend
    from shardwise.core.spec import ShardSpec as ShardSpec
    from shardwise.core.styles import PackedColwise as PackedColwise
    from shardwise.core.styles import PackedRowwise as PackedRowwise
    from shardwise.hf.adapter_hub import load_adapter as load_adapter
    from shardwise.hf.pretrained import empty_model as empty_model
    from shardwise.hf.pretrained import from_pretrained as from_pretrained
    from shardwise.io.check import inspect_checkpoint as inspect
    from shardwise.io.check.diff import diff as diff
    from shardwise.io.check.verify import verify as verify
    from shardwise.io.consolidate import consolidate as consolidate
    from shardwise.io.formats.dcp.optim import load_optimizer as load_optimizer
    from shardwise.io.formats.dcp.optim import save_optimizer as save_optimizer
    from shardwise.io.load import load as load
    from shardwise.io.save import save as save
    from shardwise.parallel import clip_grad_norm_ as clip_grad_norm_
    from shardwise.parallel import parallelize as parallelize
    from shardwise.plan_probe import check_plan as check_plan
    from shardwise.transfer import transfer_plan as transfer_plan
    from shardwise.validate import validate as validate

# public name -> (module, attribute), imported on first use so that `import shardwise` stays light
# (no torch: `shardwise --help` answers at once)
_LAZY = {
    "Backend": ("shardwise.backends", "Backend"),
    "init_backend": ("shardwise.backends", "init_backend"),
    "shutdown_backend": ("shardwise.backends", "shutdown_backend"),
    "parallelize": ("shardwise.parallel", "parallelize"),
    "clip_grad_norm_": ("shardwise.parallel", "clip_grad_norm_"),
    "ShardSpec": ("shardwise.core.spec", "ShardSpec"),
    "PackedColwise": ("shardwise.core.styles", "PackedColwise"),
    "PackedRowwise": ("shardwise.core.styles", "PackedRowwise"),
    "load": ("shardwise.io.load", "load"),
    "save": ("shardwise.io.save", "save"),
    "consolidate": ("shardwise.io.consolidate", "consolidate"),
    "save_optimizer": ("shardwise.io.formats.dcp.optim", "save_optimizer"),
    "load_optimizer": ("shardwise.io.formats.dcp.optim", "load_optimizer"),
    "inspect": ("shardwise.io.check", "inspect_checkpoint"),
    "verify": ("shardwise.io.check.verify", "verify"),
    "diff": ("shardwise.io.check.diff", "diff"),
    "from_pretrained": ("shardwise.hf.pretrained", "from_pretrained"),
    "empty_model": ("shardwise.hf.pretrained", "empty_model"),
    "validate": ("shardwise.validate", "validate"),
    "transfer_plan": ("shardwise.transfer", "transfer_plan"),
    "load_adapter": ("shardwise.hf.adapter_hub", "load_adapter"),
    "save_adapter": ("shardwise.adapters", "save_adapter"),
    "check_plan": ("shardwise.plan_probe", "check_plan"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*__all__, "errors"})


__all__ = [
    "__version__",
    # runtime
    "Backend", "init_backend", "shutdown_backend", "parallelize", "clip_grad_norm_",
    # plans
    "ShardSpec", "PackedColwise", "PackedRowwise", "check_plan",
    # checkpoints
    "load", "save", "consolidate", "save_optimizer", "load_optimizer", "from_pretrained",
    "empty_model", "inspect", "verify", "diff", "validate",
    # weights between two layouts in memory
    "transfer_plan",
    # LoRA adapters on a sharded model
    "load_adapter", "save_adapter",
    # errors (every one is in shardwise.errors)
    "ShardwiseError", "CheckpointError", "CollectiveError", "PlanError", "UsageError",
]
