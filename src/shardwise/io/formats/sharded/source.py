"""Sharded safetensors checkpoints, the format of torch's
``HuggingFaceStorageWriter(save_distributed=True)``: rank-local files whose headers hold
``DCP_SHARDING_INFO`` (each entry's ``saved_offsets``) and ``DCP_VERSION``. No pickle. A tensor's
global shape is the largest ``offset + size``, so its chunks are checked to tile it exactly (and
to agree with ``shardwise.json`` when there is one) before any data is read. Detection reads
headers, never file names. :class:`ShardedSource` reads at any degree, each rank only the chunk
bytes its regions overlap (a tensor is a ``Composite`` of its chunks), in the load's read mode
(``io.read.modes``: dp replicas and an object store's job share the reads, as for safetensors)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeGuard

import torch
from torch import nn

from shardwise.core.header import FileHeader, NamedDtype, TensorEntry, check_tiling, parse_json_object
from shardwise.core.pieces import Composite, Piece
from shardwise.core.spec import Layout, Region, local_layout
from shardwise.errors import CheckpointError
from shardwise.io.formats.safetensors.files import INDEX_SUFFIX, read_header
from shardwise.io.formats.safetensors.keys import match_keys
from shardwise.io.info import INFO_FILE, chunk_key, digest_range, read_info
from shardwise.io.read.modes import read_items
from shardwise.io.read.reader import (
    Assembly,
    ReadItem,
    RegionReader,
    piece_items,
    read_composite_box,
)
from shardwise.io.source import Blob, Description, Finalize, ReadOptions, Reads, Want
from shardwise.io.storage import Handles, Location, locate

SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
VERSION_KEY = "DCP_VERSION"
VERSION = "1.0"          # torch writes str(HF_DCP_VERSION) == "1.0"
OFFSETS_KEY = "saved_offsets"


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: the file entry holding it and the box of the global
    tensor it fills (``region.sizes == entry.shape``)."""

    path: Location
    entry: TensorEntry
    region: Region


@dataclass(frozen=True)
class ShardedTensor(NamedDtype):
    """A tensor of a sharded checkpoint: safetensors dtype name, global shape, its chunks."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def composite(self) -> Composite:
        """The tensor as the pieces its chunks are (one chunk of a tensor per file)."""
        pieces = tuple(Piece(str(c.path), Region((0,) * len(c.entry.shape), c.entry.shape), c.region.offsets)
                       for c in self.chunks)
        return Composite(self.shape, pieces, {str(c.path): (c.path, c.entry) for c in self.chunks})


@dataclass
class ShardedCheckpoint:
    """A validated sharded checkpoint: the ``KeyedCheckpoint`` that ``match_keys`` reads."""

    root: Location
    files: list[Location]
    headers: dict[Location, FileHeader]
    tensors: dict[str, ShardedTensor]
    info: dict | None = None  # shardwise.json, when the folder has one

    @property
    def names(self) -> list[str]:
        return list(self.tensors)

    def entry(self, name: str) -> tuple[Location, ShardedTensor]:
        try:
            return self.root, self.tensors[name]
        except KeyError:
            raise CheckpointError(
                f"{self.root}: the checkpoint has no tensor {name!r} ({len(self.tensors)} tensors)"
            ) from None


# --- detection -----------------------------------------------------------------------------

def _data_files(root: Location) -> list[Location]:
    files = root.glob("*.safetensors")
    for p in files:
        root.storage.check_inside(root, p, source=root)
    return files


def is_sharded_safetensors(root: Location | str | os.PathLike) -> bool:
    """True when ``root`` is a folder of safetensors files whose headers carry
    ``DCP_SHARDING_INFO`` and no ``*.safetensors.index.json`` (an index names an ordinary
    checkpoint, such as torch's consolidation into the same folder). Reads only headers; a
    corrupt header raises ``CheckpointError`` naming the file.

    >>> is_sharded_safetensors(locate("out/hf_dcp"))            # doctest: +SKIP
    True
    """
    root = locate(root)  # a str or path: the tools' and tests' door
    if not root.is_folder() or root.glob("*" + INDEX_SUFFIX):
        return False
    return any(SHARDING_INFO_KEY in read_header(p).metadata for p in _data_files(root))


# --- the chunk map ---------------------------------------------------------------------------

def _is_offsets(value: object, ndim: int) -> TypeGuard[list[int]]:
    return (isinstance(value, list) and len(value) == ndim
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value))


def file_offsets(path: Location, header: FileHeader) -> dict[str, tuple[int, ...]]:
    """``{tensor: saved offsets}`` of one file, checked against its entries. Pure."""
    meta = header.metadata
    if SHARDING_INFO_KEY not in meta:
        raise CheckpointError(
            f"{path}: its header has no {SHARDING_INFO_KEY}, but other files of the folder do; "
            "an ordinary safetensors file among the shards (a consolidated copy?): move it out")
    version = meta.get(VERSION_KEY)
    if version is not None and version.split(".")[0] != VERSION.split(".")[0]:
        raise CheckpointError(
            f"{path}: {VERSION_KEY} is {version!r}; shardwise reads version {VERSION} "
            "(written by a newer torch?); consolidate it with that torch first")
    raw = meta[SHARDING_INFO_KEY].encode("utf-8")
    info = parse_json_object(raw, source=str(path), what=SHARDING_INFO_KEY)
    for name in info:
        if name not in header.entries:
            raise CheckpointError(f"{path}: {SHARDING_INFO_KEY} lists tensor {name!r}, "
                                  "which the file does not hold; the header is corrupt")
    out = {}
    for name, entry in header.entries.items():
        item = info.get(name)
        if item is None:
            raise CheckpointError(f"{path}: tensor {name!r} has no entry in {SHARDING_INFO_KEY}, "
                                  "so where it belongs is unknown; the header is corrupt")
        offsets = item.get(OFFSETS_KEY) if isinstance(item, dict) else None
        if not _is_offsets(offsets, len(entry.shape)):
            raise CheckpointError(
                f"{path}: tensor {name!r}: {SHARDING_INFO_KEY} gives {item!r:.200} but needs "
                f"{{{OFFSETS_KEY!r}: {len(entry.shape)} non-negative ints}} for shape {entry.shape}")
        out[name] = tuple(offsets)
    return out


def chunk_map(headers: Mapping[Location, FileHeader]) -> dict[str, ShardedTensor]:
    """Every tensor's global shape and chunks, from the headers (pure). Raises ``CheckpointError``
    naming file and tensor for bad sharding info or chunks that differ in dtype or rank or do
    not tile the tensor."""
    chunks: dict[str, list[Chunk]] = {}
    for path, header in headers.items():
        for name, offsets in file_offsets(path, header).items():
            entry = header.entries[name]
            chunks.setdefault(name, []).append(Chunk(path, entry, Region(offsets, entry.shape)))
    tensors = {}
    for name, found in chunks.items():
        first = found[0]
        for c in found[1:]:
            if c.entry.dtype != first.entry.dtype or len(c.entry.shape) != len(first.entry.shape):
                raise CheckpointError(
                    f"tensor {name!r}: its chunk in {c.path} is {c.entry.dtype} of shape "
                    f"{c.entry.shape} but its chunk in {first.path} is {first.entry.dtype} of "
                    f"shape {first.entry.shape}; the files come from different checkpoints")
        shape = tuple(max((c.region.offsets[d] + c.region.sizes[d] for c in found), default=0)
                      for d in range(len(first.entry.shape)))
        check_tiling(name, shape, [(str(c.path), c.region) for c in found])
        tensors[name] = ShardedTensor(name, first.entry.dtype, shape, tuple(found))
    return tensors


# --- a folder ---------------------------------------------------------------------------------

def _check_recorded(root: Location, tensors: Mapping[str, ShardedTensor], info: dict | None) -> None:
    """The shapes shardwise recorded at save time must be the ones the chunks make: a missing
    last chunk, or a whole missing file, shows up here and nowhere else."""
    recorded = (info or {}).get("tensors")
    if not isinstance(recorded, dict):
        return
    for name, want in recorded.items():  # read_info checked the field's types
        got = tensors.get(name)
        if got is None:
            raise CheckpointError(f"{root}: {INFO_FILE} lists tensor {name!r}, which no file holds; "
                                  "a rank's file is missing: copy the complete folder, or save again")
        if tuple(want["shape"]) != got.shape:
            raise CheckpointError(
                f"{root}: tensor {name!r}: {INFO_FILE} records shape {tuple(want['shape'])} but its chunks "
                f"make {got.shape}; a rank's file is missing: copy the complete folder, or save again")


def read_sharded(root: Location | str | os.PathLike) -> ShardedCheckpoint:
    """The validated chunk map of the sharded checkpoint folder ``root``; reads headers only.

    >>> ckpt = read_sharded(locate("out/hf_dcp"))                                  # doctest: +SKIP
    >>> [c.region for c in ckpt.tensors["lm_head.weight"].chunks]           # doctest: +SKIP
    [Region(offsets=(0, 0), sizes=(32, 32)), Region(offsets=(32, 0), sizes=(32, 32))]
    """
    root = locate(root)  # a str or path: the tools' and tests' door
    if not root.is_folder():
        raise CheckpointError(f"{root}: no such checkpoint folder")
    files = _data_files(root)
    if not files:
        raise CheckpointError(f"{root}: no .safetensors files in this folder")
    headers = {p: read_header(p) for p in files}
    tensors = chunk_map(headers)
    info = read_info(root)
    _check_recorded(root, tensors, info)
    return ShardedCheckpoint(root, files, headers, tensors, info)


def sharding_metadata(offsets: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """The header metadata of one rank-local file holding the chunks at ``offsets``
    (``{tensor: saved offsets}``), as torch's writer puts it."""
    info = {name: {OFFSETS_KEY: [int(o) for o in off]} for name, off in offsets.items()}
    return {SHARDING_INFO_KEY: json.dumps(info), VERSION_KEY: VERSION, "format": "pt"}



# --- reading ----------------------------------------------------------------------------------

def local_extent(layout: Layout) -> tuple[int, ...]:
    """The local tensor's shape: the layout's regions tile it exactly."""
    ndim = len(layout[0][0].sizes)
    return tuple(max(off[d] + r.sizes[d] for r, off in layout) for d in range(ndim))


def local_assembly(requests: Mapping[str, tuple[ShardedTensor, Layout]]) -> Assembly:
    """The chunk reads giving each local tensor of ``requests`` (``{key: (tensor, layout)}``),
    and how they are put together; only the chunk bytes a region overlaps are read. Pure."""
    assembly = Assembly()
    for key, (tensor, layout) in requests.items():
        shape = local_extent(layout) if layout else ()
        reads: list = piece_items(key, tensor.composite, layout)
        if len(reads) == 1 and reads[0][0].local_shape == shape:
            reads = [(reads[0][0], None)]  # one chunk holds it all: no copy
        assembly.add(key, shape, tensor.torch_dtype, reads)
    return assembly


def read_assembled(assembly: Assembly, *, finalize: Finalize,
                   read: Callable[[list[ReadItem], Callable], Mapping]) -> dict[str, torch.Tensor]:
    """``{key: finalize(key, local tensor)}`` for every tensor of ``assembly``, its items read by
    ``read(items, take)``; ``finalize`` runs once per key, as each tensor completes (on the
    reader's threads)."""
    results = {key: finalize(key, t) for key, t in assembly.empty.items()}

    def take(item: ReadItem, raw: torch.Tensor) -> None:
        got = assembly.take(item, raw)
        if got is not None:
            results[got[0]] = finalize(*got)

    read(assembly.items, take)
    return results


def read_local(reader: RegionReader, requests: Mapping[str, tuple[ShardedTensor, Layout]], *,
               finalize: Finalize) -> dict[str, torch.Tensor]:
    """``{key: finalize(key, local tensor)}`` for ``requests`` (``{key: (tensor, layout)}``),
    read by ``reader`` (over the checkpoint's headers), one process alone.

    >>> with RegionReader(ckpt.headers, num_threads=4) as reader:                   # doctest: +SKIP
    ...     local = read_local(reader, {"w": (ckpt.tensors["w"], layout)}, finalize=lambda k, t: t)["w"]
    """
    return read_assembled(local_assembly(requests), finalize=finalize,
                          read=lambda items, take: reader.read(items, finalize=take))


class ShardedSource:
    """The ``Source`` of a sharded safetensors checkpoint: chunk map validated on opening, keys
    and shapes matched before any read; collective only in the load's shared read modes."""

    name = "sharded"

    def __init__(self, path: Location):
        self.ckpt = read_sharded(path)
        self.root = self.ckpt.root
        self.bytes_read = 0
        self._sources: dict = {}
        self._handles = Handles()

    def tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        # the model's order when shardwise recorded it (consolidation then splits files like
        # sw.save), else by name: the format itself keeps no order
        recorded = (self.ckpt.info or {}).get("tensors")
        names = recorded if isinstance(recorded, dict) and set(recorded) == set(self.ckpt.tensors) else None
        tensors = [self.ckpt.tensors[n] for n in (names or sorted(self.ckpt.tensors))]
        return {t.name: (t.torch_dtype, t.shape) for t in tensors}

    def match(self, model: nn.Module, specs, *, strict: bool) -> tuple[list[str], list[str]]:
        self._sources, missing, unexpected = match_keys(model, specs, self.ckpt, strict=strict)
        return missing, unexpected

    def plan(self, wants: Mapping[str, Want]) -> Reads:
        requests = {}
        for key, w in wants.items():
            t = self._sources[w.name][1]
            requests[key] = (t, local_layout(t.shape, w.spec, w.degree, w.rank))
        total = sum(sum(r.numel for r, _ in layout) * t.itemsize for t, layout in requests.values())
        assembly = local_assembly(requests)
        replicated = {k for k, w in wants.items() if w.spec.replicated}  # every rank reads them whole
        whole = {name for name, (key, _) in assembly.parts.items() if key in replicated}
        return Reads(wants, total, (assembly, whole))

    def read(self, reads: Reads, *, finalize: Finalize, options: ReadOptions,
             on_bytes: Callable[[int], None] | None = None) -> dict:
        assembly, whole = reads.detail

        def read(items: list[ReadItem], take: Callable) -> Mapping:
            # in the load's mode (io.read.modes): own regions, shared by replicas, or once per job
            out, nbytes = read_items(self.ckpt.headers, items, finalize=take, options=options, whole=whole,
                                     on_bytes=on_bytes)
            self.bytes_read += nbytes
            return out

        return read_assembled(assembly, finalize=finalize, read=read)

    # --- the offline tools: consolidate, verify, diff, inspect ---

    def read_box(self, name: str, box: Region) -> torch.Tensor:
        return read_composite_box(self._handles, self.ckpt.headers, self.ckpt.tensors[name].composite, box)

    def describe(self) -> Description:
        ckpt = self.ckpt
        meta = {k: v for k, v in ckpt.headers[ckpt.files[0]].metadata.items() if k != SHARDING_INFO_KEY}
        return Description("torch distributed checkpoint in safetensors (DCP_SHARDING_INFO, no pickle)",
                           tuple(f.name for f in ckpt.files), meta, layout=ckpt.info,
                           chunks={n: len(t.chunks) for n, t in ckpt.tensors.items()})

    def blobs(self) -> Iterator[Blob]:
        for name, tensor in self.ckpt.tensors.items():
            for chunk in tensor.chunks:
                def digest(algorithm: str, chunk=chunk) -> tuple[str, None]:
                    start = self.ckpt.headers[chunk.path].data_start + chunk.entry.start
                    handle = self._handles.get(chunk.path)
                    return digest_range(handle, start, chunk.entry.nbytes, algorithm), None

                yield Blob(name, chunk_key(chunk.region.offsets), chunk.entry.nbytes, digest)

    def use_module_names(self, wanted: set[str]) -> None:
        pass  # torch's and transformers' distributed writers store module names

    def close(self) -> None:
        self._handles.close()


__all__ = [
    "Chunk", "OFFSETS_KEY", "SHARDING_INFO_KEY", "ShardedCheckpoint", "ShardedSource",
    "ShardedTensor", "VERSION", "VERSION_KEY", "chunk_map", "file_offsets", "is_sharded_safetensors",
    "local_assembly", "local_extent", "read_assembled", "read_local", "read_sharded", "sharding_metadata",
]
