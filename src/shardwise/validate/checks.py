"""Comparing what a rank holds with the one-process truth, in every holding.

A rank's local tensor is compared with its part of the canonical tensor: core's region math
(``split``: the same function every load and save path uses, pure and covered by its property
tests), then FSDP2's dim-0 chunk on a ``dp_shard`` axis. Under SPMD a parameter is one global
tensor, so it is compared whole. Any mismatch raises :class:`Mismatch` naming the tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from shardwise.backends.xla import settle
from shardwise.core.spec import split
from shardwise.holding import Holding, is_dtensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# fp32 everywhere. The sharded run sums in another order than the one-process run (rowwise
# reductions, all-reduced partial sums): ~1e-6 relative here; 1e-4 leaves room for device
# kernels (SDPA, matmul) that differ from CPU's, and is still 100x below a misplaced shard.
RTOL, ATOL = 1e-4, 1e-5


class Mismatch(AssertionError):
    """A tensor a rank holds differs from what the one-process run says it must be."""


class Deferred:
    """Mismatches kept instead of raised, so that a rank that sees one still joins the
    collectives that follow (its peers would otherwise wait in them until the timeout, and the
    suite would stop); :meth:`raise_first` ends the scenario with the first one.

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


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds, on the CPU (a DTensor's local part)."""
    if is_dtensor(t):
        t = t.to_local()
    return t.detach().cpu()


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """``p``'s gradient laid out like ``p`` (a DTensor gradient brought to its placements)."""
    g = p.grad
    if g is None:
        return None
    dp = cast("DTensor", p)  # read only when its gradient is a DTensor, which makes p one
    if is_dtensor(g) and g.placements != dp.placements:
        g = g.redistribute(dp.device_mesh, dp.placements)
    return local_of(g)


def expected_local(full: torch.Tensor, name: str, state, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of the canonical ``full`` for tensor ``name`` held as ``like``."""
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
    """The largest absolute difference; raises ``Mismatch`` beyond the tolerance (any byte
    when ``exact``)."""
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


def compare_tensors(named, truth: dict[str, torch.Tensor], state, what: str, *, exact: bool = False) -> float:
    """Compare each ``(name, held tensor)`` of ``named`` with this rank's part of ``truth[name]``;
    return the largest difference. Every name of ``truth`` must appear."""
    worst, seen = 0.0, set()
    named = list(named)
    settle([held.detach() for _, held in named])  # torch_xla: one program, not one per tensor
    for name, held in named:
        seen.add(name)
        want = expected_local(truth[name], name, state, held)
        worst = max(worst, compare(local_of(held), want, f"{what} {name!r}", exact=exact))
    missing = sorted(set(truth) - seen)
    if missing:
        raise Mismatch(f"{what}: {len(missing)} tensor(s) absent, first {missing[0]!r}")
    return worst


def compare_grads(model, truth: dict[str, torch.Tensor], state, what: str) -> float:
    worst = 0.0
    settle([p.grad for p in model.parameters() if p.grad is not None])
    for name, p in model.named_parameters():
        g = local_grad(p)
        if g is None:
            raise Mismatch(f"{what} {name!r}: no gradient")
        worst = max(worst, compare(g, expected_local(truth[name], name, state, p), f"{what} {name!r}"))
    return worst


__all__ = ["ATOL", "RTOL", "Deferred", "Mismatch", "compare", "compare_grads", "compare_tensors",
           "expected_local", "local_grad", "local_of", "same_bytes", "settle"]
