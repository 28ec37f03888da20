"""Writing sharded safetensors checkpoints: every rank streams its own canonical chunks into
rank-local files named as torch names them (``shard-{r+1}-model-{k}-of-{K}.safetensors``,
``DCP_SHARDING_INFO`` in the headers), nothing gathered. A pure plan, from the regions every
rank holds, writes each region once and checks that they tile every tensor."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

from torch import nn

import shardwise.comm as comm
from shardwise.backends import Backend, coordination_group
from shardwise.comm import agree, capture
from shardwise.core.header import check_tiling, dtype_to_str, spec_nbytes
from shardwise.core.spec import Region
from shardwise.errors import CheckpointError
from shardwise.holding import Holding
from shardwise.io.dist_save import checkpoint_info, commit, model_side_files
from shardwise.io.formats.safetensors.files import StreamingWriter, header_metadata, save_file_order
from shardwise.io.formats.sharded.source import sharding_metadata
from shardwise.io.info import chunk_key
from shardwise.io.placed import model_placed
from shardwise.io.sink import PlannedFile, Saving, WritePlan
from shardwise.io.storage import Location
from shardwise.mesh import get_shard_state

# (tensor name, safetensors dtype, canonical shape, region) of one chunk a rank holds
Held = tuple[str, str, tuple[int, ...], Region]


def held_chunks(placed: Mapping) -> list[Held]:
    """The chunks a rank holds, from ``{name: Placed}``; an empty region is dropped unless
    the tensor itself is empty (its one chunk keeps the name in the checkpoint)."""
    out = []
    for name, p in placed.items():
        dtype = dtype_to_str(p.local.dtype)
        for region, _ in p.layout:
            if region.numel or math.prod(p.shape) == 0:
                out.append((name, dtype, tuple(p.shape), region))
    return out


def assign_chunks(held: Sequence[Sequence[Held]]) -> list[list[Held]]:
    """Which rank writes which chunk, from every rank's :func:`held_chunks` (index = rank): a chunk
    several ranks hold goes to the one with the fewest bytes so far (lowest on a tie). Pure.
    Raises ``CheckpointError`` if the ranks disagree on a tensor or its chunks do not tile it."""
    tensors: dict[str, tuple[str, tuple[int, ...], int]] = {}
    holders: dict[tuple[str, Region], list[int]] = {}
    for rank, chunks in enumerate(held):
        for name, dtype, shape, region in chunks:
            known = tensors.setdefault(name, (dtype, shape, rank))
            if known[:2] != (dtype, shape):
                raise CheckpointError(
                    f"tensor {name!r} is {dtype} of shape {shape} on rank {rank} but {known[0]} of "
                    f"shape {known[1]} on rank {known[2]}; every rank must save the same model")
            holders.setdefault((name, region), []).append(rank)
    load = [0] * len(held)
    out: list[list[Held]] = [[] for _ in held]
    written: dict[str, list[tuple[str, Region]]] = {}
    for (name, region), ranks in holders.items():
        dtype, shape, _ = tensors[name]
        rank = min(ranks, key=lambda r: (load[r], r))
        load[rank] += spec_nbytes(dtype, region.sizes)
        out[rank].append((name, dtype, shape, region))
        written.setdefault(name, []).append((f"rank {rank}", region))
    for name, (_, shape, _) in tensors.items():
        check_tiling(name, shape, written[name])
    return out


def rank_files(chunks: Sequence[Held], rank: int, num_files: int) -> list[tuple[str, list[Held]]]:
    """This rank's files, named as torch names them: the ``k``-th chunk of each tensor goes to
    file ``k``. Pure."""
    files: list[list[Held]] = []
    count: Counter[str] = Counter()
    for chunk in chunks:
        count[chunk[0]] += 1
        if count[chunk[0]] > len(files):
            files.append([])
        files[count[chunk[0]] - 1].append(chunk)
    return [(f"shard-{rank + 1:05d}-model-{k:05d}-of-{num_files:05d}.safetensors", group)
            for k, group in enumerate(files, 1)]


def num_files(assigned: Sequence[Sequence[Held]]) -> int:
    """The most chunks of one tensor that one rank writes (every rank's ``-of-`` count)."""
    return max([1, *(n for chunks in assigned for n in Counter(c[0] for c in chunks).values())])


def write_file(path: Location, planned: PlannedFile, placed: Mapping) -> dict[str, dict[str, str]]:
    """Stream one rank-local file; returns its chunks' checksums, ``{tensor: {chunk key: sum}}``."""
    where = dict(zip((name for name, _, _ in planned.tensors), planned.offsets, strict=True))
    metadata = sharding_metadata(where)
    with StreamingWriter(path, planned.tensors, metadata=metadata) as writer:
        for name, _, sizes in planned.tensors:
            p = placed[name]
            off = dict(p.layout)[Region(where[name], sizes)]
            writer.write(name, p.piece(off, sizes).cpu())
    return {name: {chunk_key(where[name]): crc} for name, crc in writer.checksums.items()}


def plan_rank_files(held: Sequence[Sequence[Held]]) -> WritePlan:
    """Every rank's files, from every rank's :func:`held_chunks` (index = rank): each file in
    ``save_file``'s order, with its chunks' offsets. Pure: the same on every rank."""
    assigned = assign_chunks(held)
    count = num_files(assigned)
    files = []
    for rank, chunks in enumerate(assigned):
        for fname, group in rank_files(chunks, rank, count):
            ordered = sorted(group, key=lambda c: save_file_order((c[0], c[1], c[3].sizes)))
            specs = tuple((name, dtype, region.sizes) for name, dtype, _, region in ordered)
            files.append(PlannedFile(fname, specs, rank, tuple(region.offsets for *_, region in ordered)))
    return WritePlan(tuple(files))


def save_sharded_safetensors(model: nn.Module, path: Location, *, backend: Backend | None,
                             overwrite: bool = False, replaceable: Sequence[str] = (),
                             metadata: Mapping[str, str] | None = None, progress: bool | None = None) -> None:
    """Write ``model`` at ``path`` as a sharded safetensors checkpoint; every rank calls it and
    writes its own chunks. ``metadata`` goes into ``shardwise.json``; ``replaceable``: what
    ``overwrite`` may replace (``io.formats.checkpoint_files``). Complete or absent;
    ``path`` must be on a filesystem every rank sees.

    >>> sw.save(model, "out/hf_dcp", distributed=True, format="sharded")   # doctest: +SKIP"""
    header_metadata(metadata)  # str -> str, or a CheckpointError before anything is written
    state = get_shard_state(model)
    if state is not None and state.holding is Holding.SPMD:
        raise CheckpointError("a sharded safetensors save needs one process per device; under "
                              "holding 'spmd' save with format='dcp' (the default)")
    saving = Saving(path, overwrite=overwrite, backend=backend, replaceable=replaceable,
                    what="sw.save(distributed=True, format='sharded') to {target}",
                    every_rank_writes=True)
    with saving:
        box: dict = {}
        # no rank may miss the gather below
        agree(backend, capture(lambda: box.update(placed=model_placed(model))), what=saving.what)
        placed = box["placed"]
        held = comm.all_gather_object(held_chunks(placed), group=coordination_group(backend),
                                      purpose=saving.what)
        plan = plan_rank_files(held)
        sums: dict[str, dict[str, str]] = {}

        def write() -> None:  # this rank's files, no collective
            assert saving.folder is not None  # every rank is given the shared folder
            for planned in plan.files_of(comm.rank()):
                for name, chunks in write_file(saving.folder / planned.name, planned, placed).items():
                    sums.setdefault(name, {}).update(chunks)

        agree(backend, capture(write), what=saving.what)
        info = {**checkpoint_info(model, placed, kind="model", metadata=metadata), "storage": "safetensors"}
        commit(saving, info, sums, backend=backend, side_files=model_side_files(model))


__all__ = ["assign_chunks", "held_chunks", "num_files", "plan_rank_files", "rank_files",
           "save_sharded_safetensors", "write_file"]
