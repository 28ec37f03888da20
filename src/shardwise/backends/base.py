"""The backend protocol, and gloo, the reference backend (``backends.nccl`` is the other one torch
runs itself). Call order: ``init_backend`` constructs one backend per process and calls ``start()``
on every rank; ``mesh()`` and the collectives are then called by every rank of the group they name
(all unless a ``group`` is passed); ``shutdown()`` ends it. Subclasses set the class attributes and
override ``_device()`` and, where needed, ``start()``, ``_init_group()``, ``_make_mesh()`` and
``wait()``; an SPMD backend also ``local_shards()`` and ``local_regions()``."""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import ClassVar

import torch
import torch.distributed as dist

from shardwise import errors
from shardwise.backends.launch import meet, torchrun_env
from shardwise.errors import BackendError, CollectiveError, MeshError, ShardwiseError, UsageError
from shardwise.holding import Holding

# Mesh axes, outer to inner: replicas of the whole model, then FSDP shards, then TP.
MESH_AXES = ("dp_replicate", "dp_shard", "ep", "tp")
DEFAULT_TIMEOUT = _dt.timedelta(minutes=10)

REDUCE_OPS = {name: getattr(dist.ReduceOp, name.upper()) for name in ("sum", "max", "min", "product")}


def _as_timedelta(timeout: float | _dt.timedelta | None) -> _dt.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, _dt.timedelta):
        return timeout
    if timeout <= 0:
        raise UsageError(f"timeout must be positive seconds, got {timeout!r}")
    return _dt.timedelta(seconds=float(timeout))


def reduce_op_of(op: str):
    """The torch reduce op named ``op``, else ``UsageError``."""
    if op not in REDUCE_OPS:
        raise UsageError(f"unknown reduce op {op!r}; known: {', '.join(REDUCE_OPS)}")
    return REDUCE_OPS[op]


def describe(op: str, group, purpose: str = "") -> str:
    """How a collective is named in its errors: what for, the operation and its group's size
    (``group``: None for the default group, a process group or a DeviceMesh)."""
    size = group.size() if group is not None else dist.get_world_size() if dist.is_initialized() else 1
    named = f"{op} over {size} ranks"
    return f"{purpose} ({named})" if purpose else named


@contextmanager
def guarded(op: str, *, group=None, purpose: str = "") -> Iterator[None]:
    """Turn the failure of a collective issued inside (by us, by torch's object collectives, by a
    DTensor redistribute over a mesh passed as ``group``) into a ``CollectiveError``."""
    try:
        yield
    except ShardwiseError:
        raise
    except Exception as e:  # gloo/nccl raise RuntimeError (DistBackendError) when a peer is gone
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError.failed(describe(op, group, purpose), rank=rank, cause=e) from e


class Pending:
    """An issued collective; :meth:`wait` (idempotent) finishes it within ``timeout`` (default:
    the backend's). Without a backend (a world of one) there is nothing to finish."""

    def __init__(self, work, what: str, backend: Backend | None):
        self._work, self._what, self._backend = work, what, backend

    def wait(self, timeout=None) -> None:
        work, self._work = self._work, None
        if work is not None:
            assert self._backend is not None  # Backend.issue gives its work a backend
            self._backend.wait(work, self._what, timeout=timeout)


def settle(tensors) -> None:
    """Run every pending XLA operation as one program when any of ``tensors`` is an XLA tensor."""
    if any(isinstance(t, torch.Tensor) and t.device.type == "xla" for t in tensors):
        import torch_xla

        torch_xla.sync(wait=True)


def mesh_axes(axes: dict, total: int, what: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``(names, shape)`` of a mesh request, outer to inner; raises ``MeshError`` for an
    unknown axis, a size that is not a positive int, or sizes whose product is not
    ``total`` (``what`` names that number in the message). Pure.

    >>> mesh_axes({"tp": 2, "dp_shard": 2}, 4, "the world size")
    (('dp_shard', 'tp'), (2, 2))
    """
    unknown = sorted(set(axes) - set(MESH_AXES))
    if unknown:
        raise MeshError(f"unknown mesh axis {', '.join(unknown)}; known axes: {', '.join(MESH_AXES)}")
    if not axes:
        axes = {"tp": total}
    for name, size in axes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise MeshError(f"mesh axis {name}={size!r} must be a positive int")
    names = tuple(a for a in MESH_AXES if a in axes)
    shape = tuple(axes[a] for a in names)
    product = math.prod(shape)
    if product != total:
        desc = " x ".join(f"{a}={axes[a]}" for a in names)
        hint = ""
        if product > total and what == "the world size":
            # The usual cause: a script started with `python`, a world of one process.
            hint = (f"; launch with torchrun --nproc-per-node {product} script.py (one process "
                    "per device), or")
        raise MeshError(
            f"mesh {desc} has {product} devices but {what} is {total}{hint or ';'} "
            f"make the axis sizes multiply to {total}"
        )
    return names, shape


class Backend:
    """A process group plus the device this rank computes on.

    >>> import shardwise as sw
    >>> backend = sw.init_backend("gloo")        # doctest: +SKIP
    >>> mesh = backend.mesh(tp=backend.world_size)  # doctest: +SKIP
    """

    name: ClassVar[str] = ""
    dist_backend: ClassVar[str] = ""
    device_type: ClassVar[str] = "cpu"
    supports_dtensor: ClassVar[bool] = True   # shards held as DTensors (else local + hooks)
    supports_gather: ClassVar[bool] = True    # a gather to one rank (else all-gather only)
    supports_p2p: ClassVar[bool] = True       # isend / irecv between two ranks (transfer_plan)
    supports_all_to_all: ClassVar[bool] = True  # all_to_all_single with splits (io.exchange)
    # Why a collective's timeout cannot be honoured here (None: it is)
    timeout_limit: ClassVar[str | None] = None

    def __init__(self, *, timeout: float | _dt.timedelta | None = None):
        self.timeout = _as_timedelta(timeout)
        self.rank = 0
        self.world_size = 1
        self.local_rank = 0
        self._owns_group = False

    # -- availability and start ------------------------------------------------
    @classmethod
    def is_available(cls) -> bool:
        """True when this process could run the backend (package and device present)."""
        return True

    @property
    def holding(self) -> Holding:
        """How parameters are held: DTensors, or local shards with forward hooks."""
        return Holding.DTENSOR if self.supports_dtensor else Holding.LOCAL

    def settle(self, tensors) -> None:
        """Finish the pending device work behind ``tensors`` before they are read one by one: a
        no-op on eager backends, one program on a lazy one (torch_xla)."""
        settle(tensors)

    # -- global tensors (SPMD holding only; the others raise) ------------------------------
    def local_shards(self, tensor: torch.Tensor) -> dict[tuple[int, ...], torch.Tensor]:
        """This process's distinct shards of the global ``tensor`` on the host, by canonical offsets."""
        raise BackendError(f"backend {self.name!r} holds shards as local tensors (holding "
                           f"{self.holding.name!r}): it has no global tensor to take shards of")

    def local_regions(self, tensor: torch.Tensor) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Sorted ``(offsets, sizes)`` of this process's distinct shards of the global ``tensor``."""
        raise BackendError(f"backend {self.name!r} holds shards as local tensors (holding "
                           f"{self.holding.name!r}): it has no global tensor to list regions of")

    def _device(self) -> torch.device:
        return torch.device("cpu")

    def _init_kwargs(self) -> dict:
        return {}

    def start(self) -> None:
        """Join (or adopt) the default process group and check that its collectives reach every
        rank. Called once by ``init_backend``."""
        if dist.is_initialized():
            got = dist.get_backend()
            if self.dist_backend not in str(got):
                raise BackendError(
                    f"a process group with backend {got!r} already exists; "
                    f"shardwise backend {self.name!r} needs {self.dist_backend!r}: "
                    f"call init_backend({got!r}) or destroy the existing group first"
                )
        else:
            self._init_group()
            self._owns_group = True
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        env = torchrun_env()
        self.local_rank = env["local_rank"] if env else 0
        try:
            self._check_world()
        except BackendError:
            if self._owns_group:
                dist.destroy_process_group()
                self._owns_group = False
            raise

    def _check_world(self) -> None:
        """Raise unless an all_reduce of ones sums to the world size (an adopted ``env://`` "xla"
        group on PJRT CPU does not: its collectives are no-ops)."""
        if self.world_size == 1:
            return
        how = "adopted" if not self._owns_group else "started"
        ones = torch.ones(1, device=self.device)
        total = self.all_reduce(ones, timeout=self.timeout).item()
        if total != self.world_size:
            first = (f"destroy it and let sw.init_backend({self.name!r}) create the group, "
                     if how == "adopted" else "")
            fix = (f"{first}on a runtime whose collectives span every process (torch_xla on PJRT CPU has "
                   "no multi-process collectives), each process on its own device")
            raise BackendError(
                f"backend {self.name!r}: the process group it {how} ({dist.get_backend()!r}, "
                f"{self.world_size} ranks) does not reach the other ranks: an all_reduce of ones on "
                f"{ones.device} summed to {total:g}, not {self.world_size}; its collectives are no-ops "
                f"for these tensors, so every load and forward would be silently wrong. Fix: {fix}"
            )

    def _init_group(self) -> None:
        env = torchrun_env()
        kwargs = dict(backend=self.dist_backend, timeout=self.timeout, **self._init_kwargs())
        if env is None:
            # A world of one needs no launcher and no port: an in-process store.
            dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        else:
            dist.init_process_group(init_method="env://", rank=env["rank"],
                                    world_size=env["world_size"], **kwargs)

    @property
    def device(self) -> torch.device:
        return self._device()

    # -- mesh ---------------------------------------------------------------------
    def mesh(self, **axes: int):
        """A DeviceMesh with named axes, outer to inner ``dp_replicate, dp_shard, ep, tp``; axes
        left out are absent, no axes is ``tp`` over the world, ``ep`` alone adds ``tp=1``. The
        sizes multiply to the world size. Collective: every rank calls it.

        >>> mesh = backend.mesh(dp_shard=2, tp=2)   # doctest: +SKIP
        >>> mesh.mesh_dim_names                     # doctest: +SKIP
        ('dp_shard', 'tp')
        """
        if "ep" in axes and "tp" not in axes:  # an ep mesh always has a tp axis, of size 1 here
            axes = {**axes, "tp": 1}
        with errors.on_every_rank():  # the same axes and world on every rank
            names, shape = mesh_axes(axes, self.world_size, "the world size")
        return self._make_mesh(names, shape)

    def _make_mesh(self, names: tuple[str, ...], shape: tuple[int, ...]):  # an AxisMesh (shardwise.mesh)
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device_type, shape, mesh_dim_names=names)

    @property
    def coordination_group(self):
        """The process group for DCP's planning and object collectives: None (the default
        group), or a gloo group where the default one only moves device tensors (xla)."""
        return None

    # -- collectives (every rank of the group calls each) ------------------------------
    def issue(self, op: str, start: Callable[[], object], *, group=None, purpose: str = "") -> Pending:
        """Start a collective: ``start()`` issues it (``async_op=True``, or ``isend``/``irecv``); a
        refusal at once raises ``CollectiveError``, like a failure in :meth:`Pending.wait`."""
        what = describe(op, group, purpose)
        with guarded(op, group=group, purpose=purpose):  # gloo may refuse at once, not in wait()
            work = start()
        return Pending(work, what, self)

    def wait(self, work, what: str, *, timeout=None) -> None:
        """Finish the ``async_op=True`` collective ``work`` within ``timeout`` seconds (default:
        the backend's); a failure or a timeout raises ``CollectiveError`` naming ``what``."""
        limit = _as_timedelta(timeout) if timeout is not None else self.timeout
        try:
            work.wait(limit)
        except Exception as e:  # torch raises RuntimeError/DistBackendError subclasses
            raise CollectiveError.failed(what, rank=self.rank, cause=e,
                                         seconds=limit.total_seconds()) from e

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, group=None, timeout=None,
                   purpose: str = "") -> torch.Tensor:
        """Reduce ``tensor`` in place across the group (``op``: sum, max, min, product) and return it."""
        reduce_op = reduce_op_of(op)
        self.issue("all_reduce", partial(dist.all_reduce, tensor, reduce_op, group=group, async_op=True),
                   group=group, purpose=purpose).wait(timeout)
        return tensor

    def all_gather(self, tensor: torch.Tensor, *, group=None, timeout=None) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on every rank), in group-rank order."""
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        self.issue("all_gather", partial(dist.all_gather, out, tensor.contiguous(), group=group,
                                         async_op=True), group=group).wait(timeout)
        return out

    def gather(self, tensor: torch.Tensor, dst: int = 0, *, group=None, timeout=None):
        """Every rank's ``tensor`` on global rank ``dst`` (a list there, None elsewhere)."""
        out = None
        if self.rank == dst:
            out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        self.gather_into(tensor, out, dst, group=group, timeout=timeout)
        return out

    def gather_into(self, tensor: torch.Tensor, out: list[torch.Tensor] | None, dst: int = 0, *,
                    group=None, timeout=None) -> None:
        """Every rank's ``tensor`` written into ``out`` (one tensor per group rank) on global rank
        ``dst`` (``out`` is ignored elsewhere), point to point into buffers ``dst`` reuses: nothing
        is allocated per call. Without ``supports_gather``: an all-gather, copied into ``out``."""
        if not self.supports_gather:
            got = self.all_gather(tensor, group=group, timeout=timeout)
            if self.rank == dst:
                assert out is not None  # rank dst passes its buffers (documented contract)
                for o, g in zip(out, got, strict=True):
                    o.copy_(g)
            return
        tensor = tensor.contiguous()
        if self.rank != dst:
            self.issue("gather (send)", partial(dist.isend, tensor, dst=dst, group=group),
                       group=group).wait(timeout)
            return
        me = dist.get_group_rank(group, self.rank) if group is not None else self.rank
        assert out is not None  # rank dst passes its buffers (documented contract)
        works = []
        for i, buf in enumerate(out):
            if i == me:
                buf.copy_(tensor)
                continue
            src = dist.get_global_rank(group, i) if group is not None else i
            works.append(self.issue("gather (receive)", partial(dist.irecv, buf, src=src, group=group),
                                    group=group))
        for work in works:
            work.wait(timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, group=None, timeout=None):
        """Overwrite ``tensor`` on every rank with global rank ``src``'s and return it."""
        self.issue("broadcast", partial(dist.broadcast, tensor, src=src, group=group, async_op=True),
                   group=group).wait(timeout)
        return tensor

    def barrier(self, *, group=None, timeout=None) -> None:
        self.issue("barrier", partial(dist.barrier, group=group, async_op=True), group=group).wait(timeout)

    def shutdown(self) -> None:
        """Leave the process group (only if this backend created it)."""
        if self._owns_group and dist.is_initialized():
            if self.world_size > 1:
                # A rank that tears its connections down while a peer still uses them
                # can abort that peer inside gloo; meet first (bounded, best effort).
                try:
                    meet(self.world_size, min(self.timeout.total_seconds(), 30.0))
                except Exception:  # a peer is gone already: nothing left to protect
                    pass
            dist.destroy_process_group()
        self._owns_group = False

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, "
                f"world_size={self.world_size}, device={self.device})")


class GlooBackend(Backend):
    """CPU processes joined by gloo: the reference backend, and the one the tests run."""

    name = "gloo"
    dist_backend = "gloo"
