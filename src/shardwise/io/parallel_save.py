"""The gather save without the gather: rank 0 lays every file out (header, final size) and each
rank writes the regions it holds at their byte offsets; the bytes are the rank-0 stream's.
A tensor sharded over an axis is written by the axis group of global rank 0, anything else by
rank 0. Checksums are then read back from the files, split over the ranks by bytes, and
gathered to rank 0. Used across machines (on one, measured no faster than the stream)."""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

from shardwise.backends import coordination_group
from shardwise.comm import agree, all_gather_object, broadcast_object, capture, gather_object
from shardwise.core.header import layout_header, region_runs, spec_nbytes
from shardwise.core.pieces import Piece, piece_reads
from shardwise.core.spec import Layout, Region, local_layout
from shardwise.errors import CheckpointError, UsageError
from shardwise.io.gather import StreamSink
from shardwise.io.info import new_digest
from shardwise.io.sink import WritePlan
from shardwise.io.storage import Handles, Location, byte_view, locate, read_small, write_small

PROBE_PREFIX = ".shardwise-probe-"
# Checksums read the files back this many bytes at a time, into one reused buffer.
_READ_BLOCK = 8 << 20


# --- is the temporary folder shared? --------------------------------------------------------

def _sees_token(path: Location, token: str) -> bool:
    """Whether this rank reads ``token`` at ``path`` (tests replace it to simulate a rank on
    another filesystem)."""
    try:
        return read_small(path, what="the probe") == token.encode()
    except (OSError, CheckpointError):
        return False


def host_id() -> str:
    """This machine: its boot id (Linux) and host name (tests replace it to simulate machines)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def shared_folder(backend, folder: Location | None, *, required: bool, what: str) -> Location | None:
    """Rank 0's temporary ``folder`` on every rank when every rank sees it (rank 0 writes a token,
    every rank reads it) and, unless ``required``, the ranks span machines; else None everywhere.
    Collective. With ``required`` a rank that cannot see it raises ``CheckpointError`` on all."""
    mine = None
    if folder is not None:  # rank 0: the token holds random text, so no stale file can pass
        token = secrets.token_hex(16)
        path = folder / f"{PROBE_PREFIX}{token}"
        if capture(lambda: write_small(path, token.encode())) is None:
            mine = [str(path), token]
    group = coordination_group(backend)
    offered = broadcast_object(mine, 0, group=group, purpose=f"{what}: the shared-folder probe")
    seen = offered is not None and _sees_token(locate(offered[0]), offered[1])
    answers = all_gather_object((seen, host_id()), group=group, purpose=f"{what}: the shared-folder probe")
    verdicts = [ok for ok, _ in answers]
    if folder is not None and offered is not None:
        Path(offered[0]).unlink(missing_ok=True)  # the probe, before the folder is committed
    blind = [r for r, ok in enumerate(verdicts) if not ok]
    if blind and required:
        where = f"rank 0's temporary folder {Path(offered[0]).parent}" if offered else "a token file"
        raise CheckpointError(
            f"{what}: parallel_write=True needs every rank to see the target's filesystem, but "
            f"rank(s) {blind} cannot read {where}; pass parallel_write=None (probe and fall back "
            "to the rank-0 stream) or save to a shared filesystem")
    if blind or offered is None or (not required and len({h for _, h in answers}) == 1):
        return None
    return locate(offered[0]).parent


# --- the plan: which bytes this rank writes where --------------------------------------------

def _layout(item, state, axes: dict, rank: int) -> Layout | None:
    """This rank's regions of the model tensor ``item`` that it writes; None when it writes none."""
    if item.gathered:
        _, holds_rank0 = axes.get(item.spec.axis, (None, False))
        if not holds_rank0:  # another replica: the group holding rank 0 writes
            return None
        degree, axis_rank = state.coords(item.spec)
        return local_layout(item.shape, item.spec, degree, axis_rank)
    if rank != 0:
        return None
    zeros = (0,) * len(item.shape)
    return [(Region(zeros, item.shape), zeros)]


def _boxes(item, piece: Piece, layout: Layout, shape: tuple[int, ...]):
    """``(local tensor, [(byte offset in the stored tensor, length)])`` for each box of
    ``item``'s local shard that lands in the stored tensor ``piece`` of ``shape``; the
    tensor's bytes in C order fill the runs in order."""
    itemsize = item.local.element_size()
    for _, src, local_off in piece_reads(layout, [piece]):
        box = Piece(piece.key, src, local_off, piece.stacked).box()  # in the local shard
        data = item.local[box.slices()].reshape(src.sizes)  # drops the stacked (expert) dims
        yield data, region_runs(shape, itemsize, src.offsets, src.sizes)  # src: in the stored tensor


def _write_file(path: Location, group, offsets: dict, base: int, jobs) -> None:
    """Write this rank's boxes of one file's tensors (file created by rank 0), one box at a time,
    then commit. ``jobs[name]``: ``(item, piece, layout)`` per model tensor in stored tensor ``name``."""
    out = None
    try:
        boxes = ((name, data, runs) for name, _, shape in group for item, piece, layout in jobs[name]
                 if layout is not None for data, runs in _boxes(item, piece, layout, shape))
        for name, data, runs in boxes:
            if out is None:
                out = path.create(existing=True)
            data = data.detach().resolve_conj().resolve_neg().cpu().contiguous()
            view, pos = byte_view(data), 0
            # one write per run: a dim-0 split is one run, a dim-1 split one run per row
            for offset, length in runs:
                out.pwrite(view[pos : pos + length], base + offsets[name][0] + offset)
                pos += length
            assert pos == len(view), (pos, len(view))
        if out is not None:
            out.commit()
    finally:
        if out is not None:
            out.abort()


def _create_files(folder: Location, layouts) -> None:
    """Rank 0: every file with its header, at its final size (the data zero until written)."""
    for fname, prefix, size, _ in layouts:
        out = (folder / fname).create()
        try:
            out.write(memoryview(prefix))
            if size:  # the last byte sets the length; the rest stays a hole until written
                out.pwrite(memoryview(b"\0"), len(prefix) + size - 1)
            out.commit()
        finally:
            out.abort()


# --- checksums of what landed ----------------------------------------------------------------

def split_by_bytes(sizes: list[tuple[str, int]], world_size: int) -> list[list[str]]:
    """Names spread over ``world_size`` ranks, balanced by bytes (largest first, each to the
    least loaded rank, ties to the lower rank); the same on every rank.

    >>> split_by_bytes([("a", 8), ("b", 5), ("c", 4)], 2)
    [['a'], ['b', 'c']]
    """
    load = [0] * world_size
    out: list[list[str]] = [[] for _ in range(world_size)]
    for name, nbytes in sorted(sizes, key=lambda s: (-s[1], s[0])):
        r = min(range(world_size), key=lambda i: (load[i], i))
        out[r].append(name)
        load[r] += nbytes
    return out


def _digest(folder: Location, where: dict, names: list[str]) -> dict[str, str]:
    """``{name: checksum}`` of the stored tensors ``names``, read back from their files."""
    sums, handles = {}, Handles()
    buf = bytearray(min(_READ_BLOCK, max([where[n][2] for n in names], default=0)))
    view = memoryview(buf)
    try:
        for name in names:
            fname, pos, nbytes = where[name]
            digest = new_digest()
            for lo in range(pos, pos + nbytes, _READ_BLOCK):
                block = view[: min(_READ_BLOCK, pos + nbytes - lo)]
                handles.get(folder / fname).readinto(block, lo)
                digest.update(block)
            sums[name] = digest.hexdigest()
    finally:
        handles.close()
    return sums


# --- the save ---------------------------------------------------------------------------------

def write_parallel(backend, run, state, folder: Location, plan: WritePlan, bar, *,
                   what: str) -> dict[str, str]:
    """Write every file of ``plan`` into ``folder`` and return ``{stored tensor: checksum}`` on
    rank 0 (empty elsewhere). Collective; a failure on any rank raises on every rank."""
    rank = backend.rank if backend is not None else 0
    layouts, where = [], {}
    for f in plan.files:
        prefix, offsets = layout_header(f.tensors, plan.header)
        layouts.append((f.name, prefix, sum(spec_nbytes(dt, shape) for _, dt, shape in f.tensors), offsets))
        where.update({n: (f.name, len(prefix) + lo, hi - lo) for n, (lo, hi) in offsets.items()})
    agree(backend, capture(lambda: _create_files(folder, layouts)) if rank == 0 else None, what=what)

    def write_all():
        layout_of = {}  # model tensor -> this rank's regions of it, computed once
        for f, (_, prefix, _, offsets) in zip(plan.files, layouts, strict=True):
            jobs = {}
            for name, _, shape in f.tensors:
                part = plan.parts.get(name)
                zeros = (0,) * len(shape)
                whole = ((name, Piece(name, Region(zeros, shape), zeros)),)
                fragments = part.fragments if part is not None else whole
                jobs[name] = []
                for model_name, piece in fragments:  # the model tensors' boxes in this stored tensor
                    item = run.items[model_name]
                    if model_name not in layout_of:
                        layout_of[model_name] = _layout(item, state, run.axes, rank)
                    jobs[name].append((item, piece, layout_of[model_name]))
            _write_file(folder / f.name, f.tensors, offsets, len(prefix), jobs)

    agree(backend, capture(write_all), what=what)  # every rank has fsynced its writes
    for fname, _, size, _ in layouts:
        bar.file(fname)
        bar(size)
    world = backend.world_size if backend is not None else 1
    mine = split_by_bytes([(n, w[2]) for n, w in where.items()], world)[rank]
    sums: dict[str, str] = {}
    error = capture(lambda: sums.update(_digest(folder, where, mine)))
    agree(backend, error, what=what)
    parts = gather_object(sums, 0, group=coordination_group(backend), purpose=f"{what}: the checksums")
    if parts is None:
        return {}
    out = {name: hexdigest for part in parts for name, hexdigest in part.items()}
    assert set(out) == set(where), f"checksums for {len(out)} of {len(where)} tensors"
    return out



def wanted(parallel_write: bool | None, backend, target: Location) -> bool:
    """Whether to try the parallel path: ``True`` always, ``None`` with more than one rank; never
    for a ``target`` off the local filesystem."""
    if target.scheme is not None:
        if parallel_write is True:
            raise UsageError(f"{target}: parallel_write=True writes regions of shared local files in place; "
                             "pass parallel_write=None or False for this storage")
        return False
    if parallel_write is None:
        return backend is not None and backend.world_size > 1
    if not isinstance(parallel_write, bool):
        raise UsageError(f"parallel_write must be True, False or None, got {parallel_write!r}")
    return parallel_write


class ParallelSink(StreamSink):
    """The parallel write as the safetensors ``Sink``: the stream's plan, written by every
    rank at its regions' offsets (:func:`write_parallel`). ``folder`` in :meth:`write` is
    rank 0's temporary folder on every rank (:func:`shared_folder`)."""

    def write(self, plan: WritePlan, folder: Location | None, bar) -> dict[str, str]:
        assert folder is not None, "the parallel write needs the shared folder on every rank"
        run = self.gatherer(plan)
        return write_parallel(self.backend, run, self.state, folder, plan, bar, what=self.what)


__all__ = ["ParallelSink", "host_id", "shared_folder", "split_by_bytes", "wanted", "write_parallel"]
