"""Loads from a storage that reads once per job (``Storage.fetch_once``: an object store, where
every request costs a round trip and nothing is mapped): the job reads each byte of the
checkpoint once, in whole contiguous ranges, and the ranks exchange what each needs.

Plan, then execute. :func:`plan_exchange` (pure) takes every rank's needs (the regions of each
stored tensor that each of its reads covers) and splits them in two. A stored tensor whose
needed regions are each one contiguous byte run, and no two of them overlap (a colwise shard, a
packed colwise one, an expert), is read by each rank for itself, as a local load does. Every
other tensor (a rowwise shard is a short run per row, a replicated tensor is needed whole by
every rank, a dp replica's shard by two) goes into a pool: the pool's rows, in file order, are
cut into one contiguous slab per rank per round (``window`` bytes at most a rank), each rank
fetches its slab (one ranged read per tensor it spans), and one ``all_to_all`` per round gives
each rank the boxes of its needs that its peers fetched (:func:`shardwise.core.spec.intersect`).

:func:`read_exchanged` runs it: every rank gathers the needs and plans; then one queue of
requests (``reader.num_threads`` in flight) fetches the slabs ``DEPTH`` rounds ahead, each cut
into about one request per thread and taken before the direct tensors' requests (all queued at
the start: the NIC never waits for a round, and a round's slab lands whole before the next),
every byte landed straight into its tensor and neighbouring runs of one object (several small
tensors) merged into one request (``RemoteFile.run_requests``). Per round, once its slab is in,
the ranks exchange, and the same ``all_to_all`` carries each rank's read status to every peer
(``STATUS`` bytes after the boxes for each): a failed read raises on every rank, carrying its
message (``comm.agree``, called only then), right after the exchange of its round, whose boxes
are dropped; the direct reads' failures at the latest after the last round (a collective of
its own would wait behind the slabs where the exchange shares the store's NIC). Each local
tensor is finalized once its last byte arrives, with what a storage read gives: a host tensor
of the stored dtype and the local shape. A rank that fails
before it (opening the checkpoint, matching keys) has told its peers already: ``sw.load``
agrees on those steps first. One rank alone (tp=1 over a process group) runs the same path: its
tensors are all direct.

Memory: the job's round is ``ROUND_BYTES``, a rank's slab ``ROUND_BYTES / world``; a rank holds
``DEPTH`` slabs, a send buffer of at most what its slab sends to the ``world - 1`` others and a
receive buffer of at most their slabs (both allocated once, at the largest round, and reused):
about ``(DEPTH + 2) * ROUND_BYTES / world`` beyond the local tensors (allocated at the start,
their pages touched as their bytes land).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

import shardwise.comm as comm
from shardwise.core.header import TensorEntry
from shardwise.core.spec import Region, intersect
from shardwise.errors import CheckpointError
from shardwise.io.read.fetch import Key, Piece, Requests, dests, direct_requests, first_error, slab_requests
from shardwise.io.read.mapped import contiguous_span
from shardwise.io.read.reader import Finalize, ReadItem, RegionReader
from shardwise.mesh import MeshDims

ROUND_BYTES = 32 << 20  # the job's slabs per round
# DEPTH: rounds of slabs fetched ahead of the one exchanged (before the direct reads, all queued
# at the start). Not all: a rank far ahead takes the store's bandwidth from the slabs its peers
# wait for. MIN_ROUNDS: a pool under a round is still cut into rounds (a rank's slab at least
# MIN_SLAB), so that the first exchange starts soon and each overlaps the next fetch. Measured
# by benchmarks/cluster.py --trial (docs/benchmarks.md, cluster-on-paper): 8 ahead slower, 1
# ahead faster only on one shared NIC, where its queue runs dry at each round's end (a store's
# first-byte latency per round on a cloud store)
DEPTH, MIN_ROUNDS, MIN_SLAB = 4, 32, 256 << 10
STATUS = 8  # bytes of read status after each peer's boxes in a round (8: the boxes' alignment kept)


@dataclass(frozen=True)
class Need:
    """What read ``item`` (its index in its rank's list) takes of stored tensor ``tensor``:
    each region of ``layout`` lands at its offset in the item's local tensor."""

    item: int
    tensor: Key
    layout: tuple[tuple[Region, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Move:
    """A box of a fetched piece that goes to a rank: ``peer`` (the receiver in a send, the
    sender in a receive), ``piece`` (its index in the sender's fetch), the receiver's ``item``,
    the ``box`` (of the stored tensor) and where it lands in that item's local tensor (``at``)."""

    peer: int
    piece: int
    item: int
    box: Region
    at: tuple[int, ...]


@dataclass(frozen=True)
class Round:
    """One rank's part of a round: its ``fetch``, its ``sends`` to the other ranks (by peer) and
    its ``receives`` (by peer, its own fetch included), each pair of ranks in the same order."""

    fetch: tuple[Piece, ...]
    sends: tuple[Move, ...]
    receives: tuple[Move, ...]


@dataclass(frozen=True)
class ExchangePlan:
    """One rank's plan: the items it reads for itself (``direct``), then the ``rounds`` (the same
    number on every rank)."""

    direct: tuple[int, ...]
    rounds: tuple[Round, ...]


def _row_bytes(entry: TensorEntry) -> tuple[int, int]:
    """``(rows, bytes per row)``: a 0-d tensor is one row."""
    if not entry.shape:
        return 1, entry.itemsize
    return entry.shape[0], math.prod(entry.shape[1:]) * entry.itemsize


def _is_direct(entry: TensorEntry, needs: Sequence[Need]) -> bool:
    """Every needed region is one contiguous byte run and no two overlap: each rank reads its
    own runs itself, nothing is read twice."""
    spans = []
    for need in needs:
        for region, _ in need.layout:
            span = contiguous_span(entry, region)
            if span is None:
                return False
            spans.append(span)
    spans.sort()
    return all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:], strict=False))


def _slabs(pool: Sequence[Key], tensors: Mapping[Key, TensorEntry], num_chunks: int) -> list[list[Piece]]:
    """The pool's rows, in order, cut at row boundaries into ``num_chunks`` slabs of about equal
    bytes (each at most one row over its share)."""
    total = sum(tensors[k].nbytes for k in pool)
    chunks: list[list[Piece]] = [[] for _ in range(num_chunks)]
    base = 0
    for key in pool:
        entry = tensors[key]
        rows, step = _row_bytes(entry)
        row = 0
        while row < rows:
            k = min(num_chunks - 1, (base + row * step) * num_chunks // total)
            end = -(-(k + 1) * total // num_chunks)  # chunk k's end: its slab stops at the next row
            stop = rows if k == num_chunks - 1 else min(rows, -(-(end - base) // step))
            rest = entry.shape[1:]
            region = Region((row,) + (0,) * len(rest), (stop - row,) + tuple(rest)) if entry.shape \
                else Region((), ())
            chunks[k].append(Piece(key, region))
            row = stop
        base += rows * step
    return chunks


def _moves(piece_at: int, piece: Piece, peer: int, needs: Sequence[Need]) -> list[Move]:
    """The boxes of ``piece`` that ``needs`` take, as moves with ``peer``."""
    out = []
    for need in needs:
        if need.tensor != piece.tensor:
            continue
        for region, off in need.layout:
            box = intersect(piece.region, region)
            if box is not None:
                at = tuple(o + b - r for o, b, r in zip(off, box.offsets, region.offsets, strict=True))
                out.append(Move(peer, piece_at, need.item, box, at))
    return out


def plan_exchange(needs: Sequence[Sequence[Need]], tensors: Mapping[Key, TensorEntry], rank: int, *,
                  window: int = ROUND_BYTES) -> ExchangePlan:
    """Rank ``rank``'s plan, from ``needs[r]`` (every rank's needs, in its items' order) and the
    ``tensors`` they name (in file order: the pool keeps it). Pure and deterministic: every rank
    reaches the same slabs. Regions of a need must not overlap (a local tensor's regions never do).

    >>> e = TensorEntry("w", "F32", (4, 2), 0, 32)
    >>> rowwise = [[Need(0, ("f", "w"), ((Region((0, r), (4, 1)), (0, 0)),))] for r in (0, 1)]
    >>> p = plan_exchange(rowwise, {("f", "w"): e}, 1)
    >>> p.rounds[0].fetch, len(p.rounds[0].sends), len(p.rounds[0].receives)
    ((Piece(tensor=('f', 'w'), region=Region(offsets=(2, 0), sizes=(2, 2))),), 1, 2)
    """
    world = len(needs)
    by_tensor: dict[Key, list[list[Need]]] = {}
    for r, mine in enumerate(needs):
        for need in mine:
            layout = tuple((reg, off) for reg, off in need.layout if reg.numel)
            if layout:
                by_tensor.setdefault(need.tensor, [[] for _ in range(world)])[r].append(
                    Need(need.item, need.tensor, layout))
    pool = [k for k in tensors if k in by_tensor
            and not _is_direct(tensors[k], [n for ns in by_tensor[k] for n in ns])]
    pooled = {n.item for k in pool for n in by_tensor[k][rank]}
    direct = tuple(n.item for n in needs[rank] if n.item not in pooled)
    total = sum(tensors[k].nbytes for k in pool)
    if not total:
        return ExchangePlan(direct, ())
    num_rounds = max(1, -(-total // (world * max(1, window))), min(MIN_ROUNDS, total // (world * MIN_SLAB)))
    chunks = _slabs(pool, tensors, world * num_rounds)
    rounds = []
    for r in range(num_rounds):
        fetch = chunks[r * world + rank]
        sends = [m for i, p in enumerate(fetch) for peer in range(world) if peer != rank
                 for m in _moves(i, p, peer, by_tensor[p.tensor][peer])]
        sends.sort(key=lambda m: m.peer)  # stable: piece, need, region order within a peer
        receives = [m for src in range(world) for i, p in enumerate(chunks[r * world + src])
                    for m in _moves(i, p, src, by_tensor[p.tensor][rank])]
        rounds.append(Round(tuple(fetch), tuple(sends), tuple(receives)))
    return ExchangePlan(direct, tuple(rounds))


def exchanges(storage, dims: MeshDims | None) -> bool:
    """Whether a load from ``storage`` over ``dims`` reads once per job (:func:`read_exchanged`):
    the storage asks for it (``fetch_once``), the mesh spans a process group (one rank too: its
    reads are coalesced across tensors the same way) and its backend has an ``all_to_all``.
    Otherwise each rank reads its own regions, as from local files (a mesh over part of the
    job: its peers outside would not take part)."""
    backend = dims.comm_backend if dims is not None else None
    return (bool(getattr(storage, "fetch_once", False)) and dims is not None and dims.spans_world
            and not dims.holding.one_process and backend is not None and backend.supports_all_to_all
            and comm.is_distributed())


def read_exchanged(reader: RegionReader, items: list[ReadItem], *, finalize: Finalize, dims: MeshDims,
                   on_bytes: Callable[[int], None] | None = None, window: int | None = None) -> dict:
    """``{name: finalize(item, raw)}`` for every item, the job reading each byte once.

    Collective over the world (:func:`exchanges` holds): every rank calls it with its own items.
    ``reader`` reads (and counts, ``bytes_read``) this rank's storage reads; ``on_bytes`` is told
    each local tensor's bytes as it is finalized. A read that fails on any rank raises on every
    rank right after the exchange of its round (or, for a direct read, after the last round).
    """
    backend = dims.comm_backend
    files = {str(loc): (loc, header) for loc, header in reader.headers.items()}
    mine = [Need(i, (str(it.path), it.entry.name), tuple(it.layout)) for i, it in enumerate(items)]
    needs = comm.all_gather_object(mine, purpose="the regions every rank reads from the object store")
    tensors = _tensors(needs, files)
    me, world = dist.get_rank(), dist.get_world_size()
    plan = plan_exchange(needs, tensors, me, window=max(1, (window or ROUND_BYTES) // world))
    results: dict = {}

    def take(item: ReadItem, raw: torch.Tensor):
        if on_bytes is not None:
            on_bytes(item.nbytes)
        return finalize(item, raw)

    error: BaseException | None = None
    requests = Requests(files, reader.num_threads)
    prepared = {i: dests(items[i]) for i in plan.direct}
    try:  # a direct item whose regions do not land contiguously: the reader's pieces
        results.update(reader.read([items[i] for i, d in prepared.items() if d is None], finalize=take))
    except Exception as e:  # told to every rank by agree() below, then raised here
        error = e
    landing = _Landing(items, take, results)
    buffers = _Buffers(plan.rounds, items, me, world, comm.device_for(None, backend=backend))
    rounds = plan.rounds
    slabs: dict[int, tuple[list[torch.Tensor], list[Future]]] = {}

    def submit(number: int) -> None:  # round ``number``'s slab, ahead of the direct reads still queued
        if error is None and number < len(rounds):
            slabs[number] = slab_requests(requests, tensors, rounds[number].fetch)

    try:
        for number in range(min(DEPTH, len(rounds))):
            submit(number)
        own = direct_requests(requests, items, {i: d for i, d in prepared.items() if d}, take, results)
        del prepared
        own_futures = requests.submit(own) if error is None else []
        for number, rnd in enumerate(rounds):
            fetched, futures = slabs.pop(number, ([], []))
            error = error or first_error(futures) or first_error([f for f in own_futures if f.done()])
            submit(number + DEPTH)  # fetched ahead of the direct reads while this round is exchanged
            if _exchange(rnd, fetched, items, landing, backend, number, buffers, failed=error is not None):
                comm.agree(backend, error, what="reading the checkpoint from the object store")
        error = error or first_error(own_futures)
        comm.agree(backend, error, what="reading the checkpoint from the object store")
    finally:
        requests.close()
    reader.bytes_read += requests.bytes_read
    landing.check()
    return results


def _tensors(needs, files) -> dict[Key, TensorEntry]:
    """The entries of every stored tensor a rank needs, in file order."""
    keys = sorted({n.tensor for mine in needs for n in mine})
    out = {}
    for f, name in keys:
        header = files[f][1] if f in files else None
        if header is None or name not in header.entries:
            raise CheckpointError(f"another rank reads {name!r} of {f}, which this rank's index does not "
                                  "list; every rank must load the same checkpoint")
        out[(f, name)] = header.entries[name]
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0], kv[1].start)))


def _box_in(piece: Piece, box: Region) -> tuple[slice, ...]:
    return tuple(slice(b - p, b - p + n) for b, p, n in zip(box.offsets, piece.region.offsets, box.sizes,
                                                           strict=True))


class _Landing:
    """The local tensors being filled: allocated at their first box, finalized at their last."""

    def __init__(self, items: list[ReadItem], take, results: dict):
        self.items, self.take, self.results = items, take, results
        self.raw: dict[int, torch.Tensor] = {}
        self.left: dict[int, int] = {}

    def put(self, move: Move, data: torch.Tensor) -> None:
        item = self.items[move.item]
        if move.item not in self.raw:
            self.raw[move.item] = torch.empty(item.local_shape, dtype=item.entry.torch_dtype)
            self.left[move.item] = item.nbytes
        raw = self.raw[move.item]
        raw[tuple(slice(a, a + n) for a, n in zip(move.at, move.box.sizes, strict=True))] = data
        self.left[move.item] -= move.box.numel * item.entry.itemsize
        if self.left[move.item] == 0:
            del self.left[move.item]
            self.results[item.name] = self.take(item, self.raw.pop(move.item))

    def check(self) -> None:
        missing = [item.name for item in self.items if item.name not in self.results]
        assert not missing and not self.raw, (missing, list(self.raw))  # the plan covers every need


class _Buffers:
    """The send and receive buffers of every round: sized once for the largest, then reused
    (a fresh pair per round would be allocated and faulted in again each time). Each peer's
    part ends in ``STATUS`` bytes (the sender's read status)."""

    def __init__(self, rounds: Sequence[Round], items: list[ReadItem], me: int, world: int,
                 device: torch.device):
        self.sizes = [_sizes(rnd, items, me, world) for rnd in rounds]
        tails = STATUS * world
        self._send = torch.empty(max((sum(s) for s, _ in self.sizes), default=0) + tails, dtype=torch.uint8)
        self._recv = torch.empty(max((sum(r) for _, r in self.sizes), default=0) + tails, dtype=torch.uint8,
                                 device=device)

    def send(self, n: int) -> torch.Tensor:
        return self._send[:n]

    def recv(self, n: int) -> torch.Tensor:
        return self._recv[:n]


def _sizes(rnd: Round, items: list[ReadItem], me: int, world: int) -> tuple[list[int], list[int]]:
    """The bytes ``rnd`` sends to and receives from each rank (none to or from itself)."""
    send, recv = [0] * world, [0] * world
    for move in rnd.sends:
        send[move.peer] += move.box.numel * items[move.item].entry.itemsize
    for move in rnd.receives:
        if move.peer != me:
            recv[move.peer] += move.box.numel * items[move.item].entry.itemsize
    return send, recv


def _as_bytes(buf: torch.Tensor, at: int, n: int, dtype: torch.dtype, shape) -> torch.Tensor | None:
    """``buf[at:at + n]`` (uint8) seen as a ``dtype`` tensor of ``shape``, None where ``at`` is
    not aligned for ``dtype`` (a view cannot start mid-element)."""
    if at % torch.empty((), dtype=dtype).element_size():
        return None
    return buf[at:at + n].view(dtype).view(shape)


def _exchange(rnd: Round, fetched: list[torch.Tensor], items: list[ReadItem], landing: _Landing,
              backend, number: int, buffers: _Buffers, *, failed: bool) -> bool:
    """One round's all_to_all: each box copied once into the send buffer in plan order, each
    received box copied once from the receive buffer into its local tensor; each peer's part
    ends in this rank's read status. Whether any rank failed (then nothing lands)."""
    me = dist.get_rank()
    data_sizes, recv_data = buffers.sizes[number]
    send_sizes, recv_sizes = [n + STATUS for n in data_sizes], [n + STATUS for n in recv_data]
    send = buffers.send(sum(send_sizes))
    at, peer = 0, 0
    for move in () if failed else rnd.sends:
        while peer < move.peer:  # the parts in peer order, each closed by the status
            at, peer = at + STATUS, peer + 1
        box = fetched[move.piece][_box_in(rnd.fetch[move.piece], move.box)]
        n = box.numel() * box.element_size()
        view = _as_bytes(send, at, n, box.dtype, box.shape)
        if view is not None:
            view.copy_(box)
        else:
            send[at:at + n].copy_(box.contiguous().reshape(-1).view(torch.uint8))
        at += n
    ends = [sum(send_sizes[:r + 1]) for r in range(len(send_sizes))]
    for end in ends:
        send[end - STATUS:end] = int(failed)
    recv = buffers.recv(sum(recv_sizes))
    comm.all_to_all_single(recv, send.to(recv.device), recv_sizes, send_sizes, backend=backend,
                           purpose=f"round {number} of the exchange of the checkpoint's slabs")
    recv = recv.cpu()
    starts = [sum(recv_sizes[:r]) for r in range(len(recv_sizes))]
    if failed or any(recv[start + n] for start, n in zip(starts, recv_data, strict=True)):
        return True
    for move in rnd.receives:
        dtype = items[move.item].entry.torch_dtype
        if move.peer == me:
            data = fetched[move.piece][_box_in(rnd.fetch[move.piece], move.box)]
        else:
            n = move.box.numel * items[move.item].entry.itemsize
            at = starts[move.peer]
            aligned = _as_bytes(recv, at, n, dtype, move.box.sizes)
            if aligned is None:  # misaligned: a copy that is
                aligned = recv[at:at + n].clone().view(dtype).view(move.box.sizes)
            data = aligned
            starts[move.peer] += n
        landing.put(move, data)
    return False


__all__ = ["ExchangePlan", "Move", "Need", "Piece", "ROUND_BYTES", "Round", "exchanges", "plan_exchange",
           "read_exchanged"]
