"""The suite's checks: the world is what the launcher says, and what a rank holds equals its
part of the one-process truth; a mismatch raises :class:`Mismatch` naming the tensor."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from shardwise.backends.base import settle
from shardwise.core.spec import split
from shardwise.holding import Holding, is_dtensor, local_of

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# fp32 everywhere. The sharded run sums in another order than the one-process run (rowwise
# reductions, all-reduced partial sums): ~1e-6 relative here; 1e-4 leaves room for device
# kernels (SDPA, matmul) that differ from CPU's, and is still 100x below a misplaced shard.
RTOL, ATOL = 1e-4, 1e-5
PASS, FAIL, UNSUPPORTED = "PASS", "FAIL", "UNSUPPORTED"


class Mismatch(AssertionError):
    """A tensor a rank holds differs from what the one-process run says it must be."""


class Deferred:
    """Mismatches kept instead of raised, so that the rank still joins the collectives that
    follow (its peers would wait in them until the timeout); :meth:`raise_first` ends it.

    >>> later = Deferred()
    >>> with later:
    ...     raise Mismatch("x")
    >>> later.first
    Mismatch('x')
    """

    def __init__(self):
        self.first: Mismatch | None = None

    def __enter__(self) -> Deferred:
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if kind is not None and issubclass(kind, Mismatch):
            self.first = self.first or error
            return True
        return False

    def raise_first(self) -> None:
        if self.first is not None:
            raise self.first


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """``p``'s gradient laid out like ``p`` (a DTensor gradient brought to its placements), this
    rank's part, on the CPU."""
    g = p.grad
    if g is None:
        return None
    dp = cast("DTensor", p)  # read only when its gradient is a DTensor, which makes p one
    if is_dtensor(g) and g.placements != dp.placements:
        g = g.redistribute(dp.device_mesh, dp.placements)
    return local_of(g).detach().cpu()


def expected_local(full: torch.Tensor, name: str, state, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of the canonical ``full`` for tensor ``name`` held as ``like``: core's
    ``split``, then FSDP2's dim-0 chunk on ``dp_shard``; whole under SPMD."""
    if state is None or state.holding is Holding.SPMD:
        return full
    spec = state.specs[name]
    want = full if spec.replicated else split(full, spec, *state.coords(spec))
    mesh = getattr(like, "device_mesh", None)
    axes = getattr(mesh, "mesh_dim_names", None) or ()
    # FSDP2: dim-0 chunks over dp_shard (an empty one past the end); no mesh has no axes
    if mesh is not None and "dp_shard" in axes:
        dp = mesh["dp_shard"]
        chunks, index = torch.chunk(want, dp.size(), dim=0), dp.get_local_rank()
        want = chunks[index] if index < len(chunks) else want[:0]
    return want


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def compare(got: torch.Tensor, want: torch.Tensor, what: str, *, exact: bool = False) -> float:
    """The largest absolute difference; ``Mismatch`` beyond the tolerance (``exact``: any byte)."""
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        raise Mismatch(f"{what}: holds {tuple(got.shape)} {got.dtype}, expected "
                       f"{tuple(want.shape)} {want.dtype}")
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    if exact and not same_bytes(got, want):
        raise Mismatch(f"{what}: bytes differ from the checkpoint (max |diff| {diff:.3g})")
    if not exact and not torch.allclose(got.double(), want.double(), rtol=RTOL, atol=ATOL):
        raise Mismatch(f"{what}: max |diff| {diff:.3g} beyond rtol={RTOL:g}, atol={ATOL:g}")
    return diff


def compare_tensors(named, truth: dict[str, torch.Tensor], state, what: str, *, exact: bool = False,
                    grads: bool = False) -> float:
    """The largest difference of each ``(name, held tensor)`` (``grads``: of its gradient) from its
    part of ``truth[name]``; every name of ``truth`` must appear."""
    worst, seen = 0.0, set()
    named = list(named)
    # torch_xla: one program, not one per tensor
    settle([t for _, held in named if (t := held.grad if grads else held.detach()) is not None])
    for name, held in named:
        seen.add(name)
        got = local_grad(held) if grads else local_of(held)  # compare() takes it to the CPU
        if got is None:
            raise Mismatch(f"{what} {name!r}: no gradient")
        want = expected_local(truth[name], name, state, held)
        worst = max(worst, compare(got, want, f"{what} {name!r}", exact=exact))
    missing = sorted(set(truth) - seen)
    if missing:
        raise Mismatch(f"{what}: {len(missing)} tensor(s) absent, first {missing[0]!r}")
    return worst


# -- the world check: the backend's, the launcher's and the runtime's counts agree, and
# all-reduces of ones and of the ranks give the world's sums.
def runtime_world(backend) -> int:
    """The number of processes the runtime itself says this job has."""
    if backend.name in ("xla", "neuron_xla") or backend.holding is Holding.SPMD:
        import torch_xla.runtime as xr

        return int(xr.process_count() if backend.holding is Holding.SPMD else xr.world_size())
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
    return (FAIL if wrong else PASS), "; ".join(wrong), counts


__all__ = ["ATOL", "FAIL", "PASS", "RTOL", "UNSUPPORTED", "Deferred", "Mismatch", "check_world", "compare",
           "compare_tensors", "expected_local", "local_grad", "mesh_world",
           "runtime_world", "same_bytes", "settle"]
