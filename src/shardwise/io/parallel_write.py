"""The parallel write of the gather save, used across machines (on one it measured no faster than
the rank-0 stream): every rank writes its regions of rank 0's files, which rank 0 lays out."""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

from shardwise.backends import coordination_group
from shardwise.comm import agree, all_gather_object, broadcast_object, capture, gather_object
from shardwise.core.header import layout_header, region_runs, spec_nbytes
from shardwise.core.pieces import Piece, piece_reads
from shardwise.core.spec import Layout, Region, local_layout
from shardwise.errors import CheckpointError
from shardwise.io.gather import FileGatherer
from shardwise.io.info import ALGORITHM, digest_range
from shardwise.io.read.replicas import assign_owners
from shardwise.io.sink import WritePlan
from shardwise.io.storage import Handles, Location, byte_view, locate, read_small, write_small

PROBE_PREFIX = ".shardwise-probe-"


def _sees_token(path: Location, token: str) -> bool:
    """Whether this rank reads ``token`` at ``path`` (tests replace it: a rank on another filesystem)."""
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
    """Rank 0's temporary ``folder`` on every rank when every rank reads rank 0's token in it and,
    unless ``required``, the ranks span machines; else None everywhere (``required``: a
    ``CheckpointError`` on every rank). Collective."""
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
    if folder is not None and offered is not None:
        Path(offered[0]).unlink(missing_ok=True)  # the probe, before the folder is committed
    blind = [r for r, (ok, _) in enumerate(answers) if not ok]
    if blind and required:
        where = f"rank 0's temporary folder {Path(offered[0]).parent}" if offered else "a token file"
        raise CheckpointError(
            f"{what}: parallel_write=True needs every rank to see the target's filesystem, but "
            f"rank(s) {blind} cannot read {where}; pass parallel_write=None (probe and fall back "
            "to the rank-0 stream) or save to a shared filesystem")
    if blind or offered is None or (not required and len({h for _, h in answers}) == 1):
        return None
    return locate(offered[0]).parent


def _layout(item, axes: dict, rank: int) -> Layout | None:
    """This rank's regions of the model tensor ``item`` that it writes; None when it writes none."""
    if item.gathered:
        _, holds_rank0 = axes.get(item.spec.axis, (None, False))
        if not holds_rank0:  # another replica: the group holding rank 0 writes
            return None
        return local_layout(item.shape, item.spec, item.degree, item.rank)
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


def _write_file(path: Location, plan: WritePlan, tensors, base: int, offsets: dict, run, layout_of) -> None:
    """Write this rank's boxes of the ``tensors`` of one file (created by rank 0, its data at
    ``base``), one box at a time, then commit. ``layout_of``: this rank's regions per model tensor."""
    out = None
    try:
        for name, _, shape in tensors:
            part, zeros = plan.parts.get(name), (0,) * len(shape)
            whole = ((name, Piece(name, Region(zeros, shape), zeros)),)
            for model_name, piece in part.fragments if part is not None else whole:  # model tensors' boxes
                if layout_of[model_name] is None:
                    continue
                for data, runs in _boxes(run.items[model_name], piece, layout_of[model_name], shape):
                    out = path.create(existing=True) if out is None else out
                    data = data.detach().resolve_conj().resolve_neg().cpu().contiguous()  # alive while viewed
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


def _digest(folder: Location, where: dict, names: list[str]) -> dict[str, str]:
    """``{name: checksum}`` of the stored tensors ``names``, read back from their files."""
    handles = Handles()
    try:
        return {n: digest_range(handles.get(folder / where[n][0]), where[n][1], where[n][2], ALGORITHM)
                for n in names}
    finally:
        handles.close()


def write_parallel(backend, run: FileGatherer, folder: Location, bar, *, what: str) -> dict[str, str]:
    """Write every file of ``run.plan`` into ``folder`` (:func:`shared_folder`): a sharded tensor
    by the axis group of global rank 0, anything else by rank 0; then read the checksums back,
    split by bytes. Returns ``{stored tensor: checksum}`` on rank 0 (empty elsewhere).
    Collective: a failure raises on every rank."""
    rank, plan = run.rank, run.plan
    layouts, where = [], {}
    for f in plan.files:
        prefix, offsets = layout_header(f.tensors, plan.header)
        layouts.append((f.name, prefix, sum(spec_nbytes(dt, shape) for _, dt, shape in f.tensors), offsets))
        where.update({n: (f.name, len(prefix) + lo, hi - lo) for n, (lo, hi) in offsets.items()})
    agree(backend, capture(lambda: _create_files(folder, layouts)) if rank == 0 else None, what=what)

    def write_all():
        layout_of = {n: _layout(item, run.axes, rank) for n, item in run.items.items()}
        for f, (_, prefix, _, offsets) in zip(plan.files, layouts, strict=True):
            _write_file(folder / f.name, plan, f.tensors, len(prefix), offsets, run, layout_of)

    agree(backend, capture(write_all), what=what)  # every rank has fsynced its writes
    for fname, _, size, _ in layouts:
        bar.file(fname)
        bar(size)
    world = backend.world_size if backend is not None else 1
    names = sorted(where)  # the checksums split by bytes (largest first, to the least loaded rank)
    owners = assign_owners(["all"] * len(names), {"all": range(world)}, [where[n][2] for n in names])
    mine = [n for n, owner in zip(names, owners, strict=True) if owner == rank]
    sums: dict[str, str] = {}
    error = capture(lambda: sums.update(_digest(folder, where, mine)))
    agree(backend, error, what=what)
    parts = gather_object(sums, 0, group=coordination_group(backend), purpose=f"{what}: the checksums")
    if parts is None:
        return {}
    out = {name: hexdigest for part in parts for name, hexdigest in part.items()}
    assert set(out) == set(where), f"checksums for {len(out)} of {len(where)} tensors"
    return out


__all__ = ["host_id", "shared_folder", "write_parallel"]
