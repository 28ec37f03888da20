"""CUDA GPUs joined by NCCL: one process per GPU, shards held as DTensors."""

from __future__ import annotations

import torch

from shardwise.backends.base import Backend, torchrun_env
from shardwise.errors import BackendError


class NcclBackend(Backend):
    name = "nccl"
    dist_backend = "nccl"
    device_type = "cuda"

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0

    def start(self) -> None:
        # Refuse here, before torch fails deep inside ProcessGroupNCCL.
        if not torch.cuda.is_available():
            raise BackendError(
                "backend 'nccl' needs CUDA GPUs, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                "install a CUDA build of torch on a GPU machine, or use init_backend('gloo')"
            )
        env = torchrun_env()
        self.local_rank = env["local_rank"] if env else 0
        if self.local_rank >= torch.cuda.device_count():
            raise BackendError(
                f"LOCAL_RANK={self.local_rank} but only {torch.cuda.device_count()} CUDA device(s) "
                "are visible; launch at most one process per GPU"
            )
        torch.cuda.set_device(self.local_rank)
        super().start()

    def _init_kwargs(self) -> dict:
        return {"device_id": torch.device("cuda", self.local_rank)}

    def _device(self) -> torch.device:
        return torch.device("cuda", self.local_rank)
