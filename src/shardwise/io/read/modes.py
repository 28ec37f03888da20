"""How a load reads its regions, decided once by the load pipeline (:func:`read_mode`) and
handed to the format in ``ReadOptions.mode``; the format names its items and :func:`read_items`
reads them in that mode: each rank its own regions, dp replicas each region once
(``replicas``), or the job each byte once (``exchange``). Every format reads through here, so a
sharded folder shares its reads as a safetensors file does."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from shardwise.core.header import FileHeader
from shardwise.io.read.exchange import exchanges, read_exchanged
from shardwise.io.read.reader import Finalize, ReadItem, RegionReader
from shardwise.io.read.replicas import read_once
from shardwise.io.source import ReadMode, ReadOptions
from shardwise.io.storage import Location
from shardwise.mesh import MeshDims


def read_mode(storage, dims: MeshDims) -> ReadMode:
    """The read mode of a load from ``storage`` over ``dims``: ``JOB`` where the storage reads
    once per job and the mesh can exchange (:func:`~shardwise.io.read.exchange.exchanges`),
    else ``REPLICAS`` where dp replicas share the reads, else ``OWN``."""
    if exchanges(storage, dims):
        return ReadMode.JOB
    return ReadMode.REPLICAS if dims.shares_reads else ReadMode.OWN


def read_items(headers: Mapping[Location, FileHeader], items: list[ReadItem], *, finalize: Finalize,
               options: ReadOptions, whole: frozenset[str] | set[str] = frozenset(),
               on_bytes: Callable[[int], None] | None = None,
               viewable: Callable[[ReadItem], bool] | None = None) -> tuple[dict, int]:
    """``({name: finalize(item, raw)}, bytes this rank read from storage)`` for ``items`` of the
    files of ``headers``, read in ``options.mode``; collective in ``REPLICAS`` and ``JOB`` (every
    rank calls it, in the same order as its peers). ``whole``: the items every rank reads in full
    (replicated tensors: shared by the whole job under ``REPLICAS``); ``on_bytes`` is told each
    byte this rank gets, read or received; ``viewable``: items that may be page-cache views."""
    mode, mesh = options.mode, options.mesh
    job = mode is ReadMode.JOB
    with RegionReader(headers, num_threads=options.num_threads, viewable=viewable,
                      on_bytes=None if job else on_bytes) as reader:
        if job:
            assert mesh is not None  # read_mode's condition
            out = read_exchanged(reader, items, finalize=finalize, dims=mesh, on_bytes=on_bytes)
        elif mode is ReadMode.REPLICAS:
            assert mesh is not None
            out = read_once(reader, items, finalize=finalize, dims=mesh, whole=set(whole), on_bytes=on_bytes)
        else:
            out = reader.read(items, finalize=finalize)
    return out, reader.bytes_read


__all__ = ["read_items", "read_mode"]
