"""A shardwise backend on the fake host device over a device-only group: the nccl backend's
shape (one process per device, DTensor holding, a group that takes device tensors only) without
CUDA, so that the CPU suite runs every path a CUDA/NCCL job runs with the device checks NCCL makes.

Call :func:`install` in each rank before ``sw.init_backend(NAME)``.
"""

from __future__ import annotations

import torch

from fakes import device
from fakes.device import groups
from shardwise.backends.base import Backend

NAME = "fake_nccl"
DEVICE = "fakedev"


class DeviceOnlyBackend(Backend):
    name = NAME
    dist_backend = NAME
    device_type = DEVICE
    supports_dtensor = True
    supports_gather = True

    def _device(self) -> torch.device:
        return torch.device(DEVICE, 0)


def install(lib: str) -> None:
    """The fake device as ``"fakedev"``, its device-only group as ``fake_nccl``, and this backend."""
    from shardwise import backends

    device.use_privateuse1(DEVICE, lib)
    groups.register_device_group(NAME, DEVICE)
    if NAME not in backends._registry:
        backends.register_backend(NAME, DeviceOnlyBackend)


__all__ = ["DEVICE", "NAME", "DeviceOnlyBackend", "install"]
