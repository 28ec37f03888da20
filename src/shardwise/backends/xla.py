"""TPU (and other PJRT devices) through torch_xla: one process per device.

Shards are held as plain local tensors with forward hooks doing the collectives,
because DTensor does not run on XLA devices. torch_xla is imported only here,
inside functions, so ``import shardwise`` never needs it.
"""

from __future__ import annotations

import os

import torch

from shardwise.backends.base import Backend
from shardwise.errors import BackendError, BackendUnavailableError

XLA_HINT = "pip install 'shardwise[xla]' (torch-xla must match your torch version)"


def import_torch_xla():
    """torch_xla, or BackendUnavailableError with the install hint."""
    try:
        import torch_xla  # noqa: F401
        import torch_xla.core.xla_model as xm
    except ImportError as e:
        raise BackendUnavailableError(
            f"backend 'xla' needs torch_xla, which is not importable ({e}); {XLA_HINT}"
        ) from e
    return xm


class XlaBackend(Backend):
    name = "xla"
    dist_backend = "xla"
    device_type = "xla"
    supports_dtensor = False
    supports_gather = False

    @classmethod
    def is_available(cls) -> bool:
        if not os.environ.get("PJRT_DEVICE"):
            try:
                import importlib.util

                if importlib.util.find_spec("torch_xla") is None:
                    return False
            except (ImportError, ValueError):
                return False
        try:
            import torch_xla.runtime as xr

            return bool(xr.device_type())
        except Exception:  # any failure to reach a PJRT device means "not here"
            return False

    def start(self) -> None:
        import_torch_xla()
        import torch.distributed as dist

        if not dist.is_initialized():
            import torch_xla.distributed.xla_backend  # noqa: F401  (registers "xla")

            try:
                dist.init_process_group("xla", init_method="xla://", timeout=self.timeout)
            except Exception as e:
                raise BackendError(f"could not start the xla process group: {e}; is PJRT_DEVICE set?") from e
            self._owns_group = True
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self._started = True

    def _device(self) -> torch.device:
        xm = import_torch_xla()
        return xm.xla_device()
