"""Loads from a storage that reads once per job (``Storage.fetch_once``: an object store, where
every request costs a round trip and nothing is mapped): the job reads each byte of the
checkpoint once, in whole contiguous ranges, and the ranks exchange what each needs.

:func:`read_exchanged` gathers every rank's needs and plans (:mod:`.exchange_plan`: which
tensors each rank reads for itself, the pool's slabs per round, the boxes each rank sends each
peer), then runs the plan: one queue of requests (``reader.num_threads`` in flight) fetches the
slabs ``DEPTH`` rounds ahead, each cut into about one request per thread and taken before the
direct tensors' requests (all queued at the start: the NIC never waits for a round, and a
round's slab lands whole before the next), every byte landed straight into its tensor and
neighbouring runs of one object (several small tensors) merged into one request
(``RemoteFile.run_requests``). Per round, once its slab is in, one ``all_to_all`` gives each
rank the boxes its peers fetched for it, and carries each rank's read status to every peer
(``STATUS`` bytes after the boxes for each): a failed read raises on every rank, carrying its
message (``comm.agree``, called only then), right after the exchange of its round, whose boxes
are dropped; the direct reads' failures at the latest after the last round (a collective of
its own would wait behind the slabs where the exchange shares the store's NIC). Each local
tensor is finalized once its last byte arrives, with what a storage read gives: a host tensor
of the stored dtype and the local shape. A rank that fails before it (opening the checkpoint,
matching keys) has told its peers already: ``sw.load`` agrees on those steps first. One rank
alone (tp=1 over a process group) runs the same path: its tensors are all direct.

Memory: the job's round is ``ROUND_BYTES``, a rank's slab ``ROUND_BYTES / world``; a rank holds
``DEPTH`` slabs, a send buffer of at most what its slab sends to the ``world - 1`` others and a
receive buffer of at most their slabs (both allocated once, at the largest round, and reused):
about ``(DEPTH + 2) * ROUND_BYTES / world`` beyond the local tensors (allocated at the start,
their pages touched as their bytes land).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch
import torch.distributed as dist

import shardwise.comm as comm
from shardwise.core.header import TensorEntry
from shardwise.core.spec import Region
from shardwise.errors import CheckpointError
from shardwise.io.read.exchange_plan import ROUND_BYTES, ExchangePlan, Move, Need, Round, plan_exchange
from shardwise.io.read.fetch import Key, Piece, Requests, dests, direct_requests, first_error, slab_requests
from shardwise.io.read.reader import Finalize, ReadItem, RegionReader
from shardwise.mesh import MeshDims

# DEPTH: rounds of slabs fetched ahead of the one exchanged (before the direct reads, all queued
# at the start). Not all: a rank far ahead takes the store's bandwidth from the slabs its peers
# wait for. Measured by benchmarks/cluster.py --trial (docs/benchmarks.md, cluster-on-paper): 8
# ahead slower, 1 ahead faster only on one shared NIC, where its queue runs dry at each round's
# end (a store's first-byte latency per round on a cloud store)
DEPTH = 4
STATUS = 8  # bytes of read status after each peer's boxes in a round (8: the boxes' alignment kept)


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


def _starts(sizes: list[int]) -> list[int]:
    """Where each peer's part starts in a buffer of parts of ``sizes``, in peer order."""
    return [sum(sizes[:r]) for r in range(len(sizes))]


def _exchange(rnd: Round, fetched: list[torch.Tensor], items: list[ReadItem], landing: _Landing,
              backend, number: int, buffers: _Buffers, *, failed: bool) -> bool:
    """One round's all_to_all: each box copied once into the send buffer in plan order, each
    received box copied once from the receive buffer into its local tensor; each peer's part
    ends in this rank's read status. Whether any rank failed (then nothing lands)."""
    me = dist.get_rank()
    data_sizes, recv_data = buffers.sizes[number]
    send_sizes, recv_sizes = [n + STATUS for n in data_sizes], [n + STATUS for n in recv_data]
    send = buffers.send(sum(send_sizes))
    starts = _starts(send_sizes)
    at = list(starts)  # where the next box to each peer goes: the parts in peer order
    for move in () if failed else rnd.sends:
        box = fetched[move.piece][_box_in(rnd.fetch[move.piece], move.box)]
        n = box.numel() * box.element_size()
        pos = at[move.peer]
        view = _as_bytes(send, pos, n, box.dtype, box.shape)
        if view is not None:
            view.copy_(box)
        else:
            send[pos:pos + n].copy_(box.contiguous().reshape(-1).view(torch.uint8))
        at[move.peer] = pos + n
    for start, n in zip(starts, data_sizes, strict=True):  # each part closed by the status
        send[start + n:start + n + STATUS] = int(failed)
    recv = buffers.recv(sum(recv_sizes))
    comm.all_to_all_single(recv, send.to(recv.device), recv_sizes, send_sizes, backend=backend,
                           purpose=f"round {number} of the exchange of the checkpoint's slabs")
    recv = recv.cpu()
    starts = _starts(recv_sizes)
    if failed or any(recv[start + n] for start, n in zip(starts, recv_data, strict=True)):
        return True
    for move in rnd.receives:
        dtype = items[move.item].entry.torch_dtype
        if move.peer == me:
            data = fetched[move.piece][_box_in(rnd.fetch[move.piece], move.box)]
        else:
            n = move.box.numel * items[move.item].entry.itemsize
            pos = starts[move.peer]
            aligned = _as_bytes(recv, pos, n, dtype, move.box.sizes)
            if aligned is None:  # misaligned: a copy that is
                aligned = recv[pos:pos + n].clone().view(dtype).view(move.box.sizes)
            data = aligned
            starts[move.peer] += n
        landing.put(move, data)
    return False


__all__ = ["ExchangePlan", "Move", "Need", "Piece", "ROUND_BYTES", "Round", "exchanges", "plan_exchange",
           "read_exchanged"]
