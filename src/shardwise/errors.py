"""Errors raised by shardwise: each names what is wrong and how to fix it. Bad input raises a
``ValueError`` subclass, an environment or runtime fault a ``RuntimeError`` (``OSError`` for a
file system fault); all derive from ``ShardwiseError``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class ShardwiseError(Exception):
    """Base class of every error shardwise raises on purpose."""


class BackendError(ShardwiseError, RuntimeError):
    """A backend could not be started or used (no device, process group failure)."""


class BackendUnavailableError(BackendError):
    """The hardware package a backend needs (torch_xla, torch_neuronx) is not installed."""


class UnknownBackendError(ShardwiseError, ValueError):
    """A backend name that is not registered."""


class CollectiveError(BackendError):
    """A collective operation failed or timed out; carries what each rank reported."""

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        self.failures = dict(failures or {})
        if self.failures:
            detail = "\n".join(f"  rank {r}: {f}" for r, f in sorted(self.failures.items()))
            message = f"{message}\n{detail}"
        super().__init__(message)

    @classmethod
    def failed(cls, what: str, *, rank: int, cause: BaseException,
               seconds: float | None = None) -> CollectiveError:
        """The error of one rank whose collective ``what`` (which names the operation and its
        group size) raised ``cause`` or did not finish within ``seconds``."""
        within = f" or did not finish within {seconds:.0f} s" if seconds is not None else ""
        return cls(f"{what} failed{within} on rank {rank}: {type(cause).__name__}: {cause}. Every "
                   "rank of the group must reach the same collective calls in the same order: check "
                   "that no rank skipped this one (under `if rank == 0:`) or raised before it, and "
                   "whether a peer died (its own log says why)")


class MeshError(ShardwiseError, ValueError):
    """A mesh request that does not fit the world (axis sizes, names)."""


class PlanError(ShardwiseError, ValueError):
    """A tensor-parallel plan that cannot be applied to the model."""


class ShardingError(PlanError):
    """A tensor (or one of its packed blocks) that the degree does not divide."""


class CheckpointError(ShardwiseError, ValueError):
    """A checkpoint that is missing, malformed, incomplete or does not match the model."""


class UsageError(ShardwiseError, ValueError):
    """An argument whose value the call does not accept (an option, a name, a count)."""


class NonFiniteError(ShardwiseError, RuntimeError):
    """A computed value that must be finite is not (a gradient norm)."""


class StorageError(ShardwiseError, OSError):
    """A file system operation on a checkpoint failed (a rename refused, a permission, an
    I/O error); an ``OSError`` with the ``errno`` and file names of the failed call."""


class UnsupportedModelError(ShardwiseError, ValueError):
    """A model shardwise refuses to load or save (quantized, offloaded, PEFT-injected)."""


class TransferError(ShardwiseError, RuntimeError):
    """A model whose weights a transfer plan is updating, or failed to update: its forward is
    refused until a later ``plan.run()`` succeeds."""


@contextmanager
def on_every_rank() -> Iterator[None]:
    """Mark a ``ShardwiseError`` raised inside as one that every rank raises alike: checks that
    run before any collective, on inputs that are the same on every rank (the options, the
    mesh's shape, the model and the plan). The hook ``init_backend`` installs
    (``shardwise.backends.install_excepthook``) then reports it once, on rank 0."""
    try:
        yield
    except ShardwiseError as e:
        e.every_rank = True  # type: ignore[attr-defined]
        raise
