"""Moving weights between two models' layouts in memory: the plan computed once, run every step.

:func:`transfer_plan` is a collective of the whole world: each rank describes the parts it
holds of the source model and of the destination model (either may be None on a rank that
holds no part of it), the descriptions are all-gathered once, and every rank computes the
same pure plan (``shardwise.transfer.plan``). :meth:`TransferPlan.run` then moves, bucket by
bucket, exactly the boxes each destination shard needs, point to point.

A destination left mid-update is refused, not rolled back: a rollback needs a second copy
of every destination shard (the memory an inference engine does not have). While a run is
in flight, and after one that failed on any rank, the destination's forward raises
``TransferError``; the next run that succeeds on every rank lifts it. ``version`` counts the
runs that every rank finished.
"""

from __future__ import annotations

import math
import socket
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from shardwise import comm
from shardwise.core.header import dtype_to_str, str_to_dtype
from shardwise.core.pieces import Piece
from shardwise.core.spec import Region
from shardwise.errors import BackendError, PlanError, TransferError, UsageError
from shardwise.holding import local_of
from shardwise.io.placed import place  # the one reading of what a rank holds
from shardwise.mesh import world_backend
from shardwise.parallel import get_shard_state
from shardwise.transfer.plan import DEFAULT_BUCKET_BYTES, Holding, Move, Plan, holding_of, make_plan

if TYPE_CHECKING:
    from shardwise.backends.base import Backend

_STATUS_ATTR = "_shardwise_transfer"
NameMap = Mapping[str, "str | tuple[str, Region | tuple[Sequence[int], Sequence[int]]] | Sequence[Piece]"]


def _describe(model: nn.Module | None) -> dict[str, tuple] | None:
    """``{parameter: (canonical shape, dtype, local shape, layout)}`` of this rank's parts."""
    if model is None:
        return None
    state = get_shard_state(model)
    if state is not None and state.holding.one_process:
        raise PlanError("transfer_plan moves shards between processes; an xla_spmd model is one "
                        "process holding global tensors: move its weights with load_state_dict")
    if state is not None and state.specs.ties:
        raise PlanError("transfer_plan does not move quantized weights with their scales yet; "
                        "transfer the model in its dequantized dtype")
    out = {}
    for name, p in model.named_parameters():
        spec = state.specs.spec_of(name) if state is not None else None
        degree, rank = state.coords(spec) if state is not None and spec is not None else (1, 0)
        placed = place(p, spec, degree, rank, name=name)
        out[name] = (placed.shape, dtype_to_str(p.dtype), tuple(placed.local.shape), placed.layout)
    return out


def _holdings(descs: Sequence[dict | None], which: str) -> dict[str, Holding]:
    parts: dict[str, dict[int, tuple]] = {}
    meta: dict[str, tuple] = {}
    for rank, desc in enumerate(descs):
        for name, (shape, dtype, local, layout) in (desc or {}).items():
            if meta.setdefault(name, (shape, dtype)) != (shape, dtype):
                raise PlanError(f"{which} tensor {name!r} is {shape} {dtype} on rank {rank} but "
                                f"{meta[name]} on another; every rank must hold the same model")
            parts.setdefault(name, {})[rank] = (local, layout)
    return {n: holding_of(meta[n][0], meta[n][1], parts[n]) for n in parts}


def _pieces(names: NameMap | None, src: Mapping[str, Holding]) -> dict[str, tuple[Piece, ...]]:
    out: dict[str, tuple[Piece, ...]] = {}
    for dst, how in (names or {}).items():
        if isinstance(how, str):
            if how not in src:
                raise PlanError(f"names maps {dst!r} to {how!r}, which the source model does not have")
            zeros = (0,) * len(src[how].shape)
            out[dst] = (Piece(how, Region(zeros, src[how].shape), zeros),)
        elif isinstance(how, tuple) and len(how) == 2 and isinstance(how[0], str) and _is_box(how[1]):
            box = how[1] if isinstance(how[1], Region) else Region(*map(tuple, how[1]))
            out[dst] = (Piece(how[0], box, (0,) * len(box.sizes)),)
        elif all(isinstance(p, Piece) for p in how):
            out[dst] = tuple(p for p in how if isinstance(p, Piece))
        else:
            raise UsageError(f"names[{dst!r}] must be a source name, (source name, (offsets, sizes)) or a "
                             f"sequence of Piece, got {how!r}")
    return out


def _is_box(box) -> bool:
    return isinstance(box, Region) or (
        isinstance(box, tuple) and len(box) == 2
        and all(isinstance(v, (tuple, list)) and all(isinstance(i, int) for i in v) for v in box))


class _Status:
    """What a destination model's forward guard reads: ``"ok"``, ``"updating"`` or ``"failed"``."""

    def __init__(self):
        self.state, self.version = "ok", 0

    def __call__(self, module, args):
        if self.state != "ok":
            raise TransferError(
                f"this model's weights are {'being updated' if self.state == 'updating' else 'half updated'}"
                f" by a transfer plan (version {self.version} was the last complete one); call "
                "plan.run() again and let it succeed on every rank before running the model")


def _guard(model: nn.Module) -> _Status:
    status = model.__dict__.get(_STATUS_ATTR)
    if status is None:
        status = _Status()
        model.register_forward_pre_hook(status)
        model.__dict__[_STATUS_ATTR] = status
    return status


class TransferPlan:
    """A plan between two models, replayed by :meth:`run`. Built by :func:`transfer_plan`.

    ``plan`` is the pure value (print it: bytes per link, rank pair and bucket);
    ``version`` counts the runs every rank finished.
    """

    def __init__(self, plan: Plan, src: nn.Module | None, dst: nn.Module | None, backend: Backend):
        self.plan, self._src, self._dst, self._backend = plan, src, dst, backend
        self.rank = backend.rank
        self.version = 0
        self._attempt = 0  # runs started: the tag of their messages
        self._status = _guard(dst) if dst is not None else None
        self._local = [m for m in plan.local if m.dst_rank == self.rank]
        self._buckets = [_mine(b, self.rank) for b in plan.buckets]

    def __repr__(self) -> str:
        return f"TransferPlan(version={self.version}, {self.plan!r})"

    def __str__(self) -> str:
        return str(self.plan)

    def run(self) -> int:
        """Move the source's current values into the destination; every rank of the world
        calls it. Returns the new version. Raises on every rank if any rank failed (a peer
        that died or timed out: ``CollectiveError``), leaving the destination refused."""
        if self._status is not None:
            self._status.state = "updating"
        self._attempt += 1
        error = comm.capture(self._move)
        try:
            comm.agree(self._backend, error, what="plan.run()")
        except Exception:
            if self._status is not None:
                self._status.state = "failed"
            raise
        self.version += 1
        if self._status is not None:
            self._status.state, self._status.version = "ok", self.version
        return self.version

    @property
    def _tag(self) -> int:
        # Each run's messages carry its own tag, so that a receive a failed run left posted
        # cannot take the next run's bytes where the group survived the failure (gloo matches
        # tags; after a timeout gloo closes the connection and NCCL's communicator is unusable:
        # a new process group is needed either way).
        return self._attempt % (1 << 30)

    def _tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        def of(model):  # resolved every run: the values now, not the ones at plan time
            return {} if model is None else {n: local_of(p).detach() for n, p in model.named_parameters()}
        return of(self._src), of(self._dst)

    def _move(self) -> None:
        src, dst = self._tensors()
        with torch.no_grad():
            for m in self._local:
                _view(dst[m.dst], m.dst_offsets, m.sizes).copy_(_view(src[m.src], m.src_offsets, m.sizes))
            # one arena for the run, carved into every bucket's buffers in turn: at most one
            # bucket of memory, its pages faulted in once (not once per bucket)
            need = max((sum(m.nbytes for v in (*s.values(), *r.values()) for m in v)
                        for s, r in self._buckets), default=0)
            some = next(iter({**src, **dst}.values()), None)
            arena = torch.empty(need, dtype=torch.uint8, device=some.device if some is not None else None)
            for i, (sends, recvs) in enumerate(self._buckets):
                self._exchange(i, sends, recvs, src, dst, arena)

    def _exchange(self, index: int, sends: dict[int, list[Move]], recvs: dict[int, list[Move]],
                  src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], arena: torch.Tensor) -> None:
        """One bucket: one flat buffer per peer each way, sent and received as one batch."""
        ops, inbox, pos = [], {}, 0
        for peer, moves in sends.items():
            size = sum(m.nbytes for m in moves)
            buf, pos = arena[pos: pos + size], pos + size
            for m, seg in _segments(moves, buf, self.plan.dtypes):
                seg.copy_(_view(src[m.src], m.src_offsets, m.sizes))  # the cast after slicing
            ops.append(dist.P2POp(dist.isend, buf, peer, tag=self._tag))
        for peer, moves in recvs.items():
            size = sum(m.nbytes for m in moves)
            inbox[peer], pos = arena[pos: pos + size], pos + size
            ops.append(dist.P2POp(dist.irecv, inbox[peer], peer, tag=self._tag))
        if not ops:
            return
        what = f"plan.run() bucket {index} ({len(sends)} sends, {len(recvs)} receives on rank {self.rank})"
        with comm.guarded("batch_isend_irecv", purpose=what):
            works = dist.batch_isend_irecv(ops)
        for work in works:
            self._backend.wait(work, what)
        for peer, moves in recvs.items():
            for m, seg in _segments(moves, inbox[peer], self.plan.dtypes):
                _view(dst[m.dst], m.dst_offsets, m.sizes).copy_(seg)


def _view(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    return t[Region(offsets, sizes).slices()]


def _segments(moves: list[Move], buf: torch.Tensor, dtypes: Mapping[str, str]):
    """``(move, typed view of buf)`` for each move, packed back to back. Moves are ordered by
    itemsize, largest first (:func:`_mine`), so every segment starts aligned."""
    pos = 0
    for m in moves:
        dtype = str_to_dtype(dtypes[m.dst])
        yield m, buf[pos: pos + m.nbytes].view(dtype).view(m.sizes)
        pos += m.nbytes


def _mine(bucket: Sequence[Move], rank: int) -> tuple[dict[int, list[Move]], dict[int, list[Move]]]:
    """``({peer: moves this rank sends it}, {peer: moves it receives from it})``, each list in
    one order both ends agree on (itemsize descending, then plan order)."""
    sends: dict[int, list[Move]] = defaultdict(list)
    recvs: dict[int, list[Move]] = defaultdict(list)
    for m in bucket:
        if m.src_rank == rank:
            sends[m.dst_rank].append(m)
        if m.dst_rank == rank:
            recvs[m.src_rank].append(m)

    def order(moves: list[Move]) -> list[Move]:
        return sorted(moves, key=lambda m: -(m.nbytes // max(1, math.prod(m.sizes))))  # stable
    return {p: order(v) for p, v in sends.items()}, {p: order(v) for p, v in recvs.items()}


def transfer_plan(src_model: nn.Module | None, dst_model: nn.Module | None, *, names: NameMap | None = None,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> TransferPlan:
    """The plan that moves ``src_model``'s parameters into ``dst_model``'s layout, in memory.

    Every rank of the world calls it, passing the models it holds a part of (None for one it
    does not: a trainer rank has no inference model). ``names`` maps a destination parameter
    to its source: a source name, ``(source name, (offsets, sizes))`` (a box of it: q out of a fused
    qkv) or a sequence of ``Piece`` (several boxes assembled); unmapped names are the same
    on both sides. Values are cast to each destination parameter's dtype, after slicing.
    Remote moves go in buckets where no rank sends plus receives more than ``bucket_bytes``.

    >>> plan = sw.transfer_plan(trainer, engine)   # once           # doctest: +SKIP
    >>> print(plan)                                # what moves where # doctest: +SKIP
    >>> plan.run()                                 # every step     # doctest: +SKIP
    """
    backend = world_backend()
    if backend is None:
        raise BackendError("transfer_plan needs a process group: call sw.init_backend() first")
    if not backend.supports_p2p:
        raise BackendError(f"the {backend.name} backend has no point-to-point sends, which "
                           "transfer_plan needs; run the transfer over a gloo or nccl group")
    mine = (_describe(src_model), _describe(dst_model), socket.gethostname())
    everyone = comm.all_gather_object(mine, purpose="transfer_plan: the layouts of both models")
    src = _holdings([e[0] for e in everyone], "source")
    dst = _holdings([e[1] for e in everyone], "destination")
    hosts = list(dict.fromkeys(e[2] for e in everyone))
    plan = make_plan(src, dst, world_size=len(everyone), nodes=[hosts.index(e[2]) for e in everyone],
                     pieces=_pieces(names, src), bucket_bytes=bucket_bytes)
    return TransferPlan(plan, src_model, dst_model, backend)


__all__ = ["TransferPlan", "transfer_plan"]
