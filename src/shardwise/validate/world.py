"""The first scenario: the world is what the launcher says, so that a world of one process per
process (torch_xla on PJRT CPU under torchrun, an adopted group that reaches no one) can never
pass the suite.

Three counts must agree: the backend's world size, the launcher's (``WORLD_SIZE``, when a
launcher set it) and the runtime's own (torch.distributed's group size; torch_xla's
``xr.world_size()`` for the xla backends; for ``xla_spmd`` its process count, while the mesh
counts XLA devices). Then two all-reduces over the backend's device must give the world's sum:
ones (everyone is there) and the ranks (each rank is there once).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from shardwise.holding import Holding
from shardwise.validate.report import FAIL, PASS


def runtime_world(backend) -> int:
    """The number of processes the runtime itself says this job has."""
    if backend.name in ("xla", "neuron_xla"):
        import torch_xla.runtime as xr

        return int(xr.world_size())
    if backend.holding is Holding.SPMD:
        import torch_xla.runtime as xr

        return int(xr.process_count())
    return dist.get_world_size() if dist.is_initialized() else 1


def mesh_world(backend) -> int:
    """The number of devices a mesh spans: processes, or under SPMD the XLA devices."""
    if backend.holding is Holding.SPMD:
        import torch_xla.runtime as xr

        return int(xr.global_runtime_device_count())
    return backend.world_size


def check_world(backend) -> tuple[str, str, dict]:
    """``(status, reason, details)`` of the world check on this rank; every rank calls it."""
    launcher = os.environ.get("WORLD_SIZE")
    counts = {"backend": backend.world_size, "runtime": runtime_world(backend),
              "launcher": int(launcher) if launcher else None, "rank": backend.rank}
    wrong = []
    if counts["runtime"] != counts["backend"]:
        wrong.append(f"the runtime counts {counts['runtime']} processes but backend "
                     f"{backend.name!r} has a world of {counts['backend']}")
    if launcher and int(launcher) != counts["backend"]:
        wrong.append(f"the launcher started WORLD_SIZE={launcher} processes but backend {backend.name!r} "
                     f"has a world of {counts['backend']}: each process is in a world of its own, so "
                     "collectives reach no other rank")
    n = backend.world_size
    ones = backend.all_reduce(torch.ones(1, device=backend.device)).item()
    ranks = backend.all_reduce(torch.tensor([float(backend.rank)], device=backend.device)).item()
    counts.update(all_reduce_ones=ones, all_reduce_ranks=ranks, mesh_devices=mesh_world(backend))
    if ones != n:
        wrong.append(f"an all_reduce of ones over the world of {n} gave {ones:g}: the collective does "
                     "not reach every rank")
    elif ranks != n * (n - 1) / 2:
        wrong.append(f"an all_reduce of the ranks gave {ranks:g}, not {n * (n - 1) // 2}: ranks are "
                     "duplicated or missing")
    if wrong:
        return FAIL, "; ".join(wrong), counts
    return PASS, "", counts


__all__ = ["check_world", "mesh_world", "runtime_world"]
