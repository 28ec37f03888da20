"""Safetensors files over a storage: validated headers, reads of boxes, the streaming writer,
and the plan of a checkpoint (which tensor goes to which file, in which order, the index),
one recipe for every writer so the same tensors give the same files byte for byte. The bytes
go through ``shardwise.io.storage``; nothing here ever unpickles.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction

import torch

from shardwise.core.header import (
    FileHeader,
    Spec,
    check_header_length,
    layout_header,
    parse_header,
    spec_nbytes,
    str_to_dtype,
)
from shardwise.errors import CheckpointError
from shardwise.io.info import new_digest, record_checksums
from shardwise.io.sink import PlannedFile, StoredTensor, WritePlan
from shardwise.io.storage import Location, WriteHandle, byte_view, locate
from shardwise.io.storage.lookups import remembered

INDEX_SUFFIX = ".safetensors.index.json"
# The writer hashes and writes a tensor this many bytes at a time (fits the CPU's L2/L3).
_WRITE_BLOCK = 2 << 20

# --- reading -----------------------------------------------------------------------------

def read_header(path: Location | str | os.PathLike) -> FileHeader:
    """The validated header of the safetensors file ``path`` (a str or path: :func:`locate`'s);
    reads only the prefix, once within a load (``lookups.one_look``: the sharded format's claim
    and the reader ask the same files).

    >>> read_header("model.safetensors").entries["w"].shape    # doctest: +SKIP
    (4096, 4096)
    """
    path = locate(path)
    return remembered((path.storage, "header", str(path)), lambda: _read_header(path))


def _read_header(path: Location) -> FileHeader:
    source = str(path)
    handle = path.open()
    try:
        size = handle.size()
        if size < 8:
            raise CheckpointError(f"{source}: {size} bytes, shorter than the 8-byte header length; truncated")
        prefix = bytearray(8)
        handle.readinto(memoryview(prefix), 0)
        n = int.from_bytes(prefix, "little")
        check_header_length(n, size, source=source)
        raw = bytearray(n)
        handle.readinto(memoryview(raw), 8)
        return parse_header(bytes(raw), data_size=size - 8 - n, source=source)
    finally:
        handle.close()


# --- writing -------------------------------------------------------------------------------

class StreamingWriter:
    """Write one safetensors file tensor by tensor, in the order of ``specs``: the header
    first, then each tensor's bytes. By hand because safetensors' writers need the whole dict
    at once, and a gather save holds one full tensor at a time. The storage's writer makes the
    file visible only at :meth:`close`; a raising ``with`` block or a tensor missing at close
    removes it. ``checksums``: :attr:`checksums` maps each written tensor to its checksum,
    reported to an enclosing ``collect_checksums()`` block when the file is complete.

    >>> with StreamingWriter("out/model.safetensors", [("w", "F32", (2, 2))]) as w:  # doctest: +SKIP
    ...     w.write("w", torch.ones(2, 2))
    """

    def __init__(
        self, path: Location | str | os.PathLike, specs: Sequence[Spec],
        metadata: Mapping[str, str] | None = None, *, checksums: bool = True,
    ):
        self.path = locate(path)
        self.checksums: dict[str, str] = {}
        self._checksums = checksums
        self._specs = [(name, dtype, tuple(shape)) for name, dtype, shape in specs]
        prefix, self._offsets = layout_header(self._specs, metadata)
        self._next = 0
        self._pos = 0  # data offsets count from the end of the header
        self._out: WriteHandle | None = self.path.create()
        try:
            self._out.write(memoryview(prefix))
        except BaseException:
            self.abort()
            raise

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append tensor ``name``; it must be the next spec, with its dtype and shape, on CPU."""
        if self._out is None:
            raise CheckpointError(f"{self.path}: the writer is closed; cannot write {name!r}")
        if self._next == len(self._specs):
            raise CheckpointError(
                f"{self.path}: all {len(self._specs)} tensors are written; got {name!r} too"
            )
        want_name, want_dtype, want_shape = self._specs[self._next]
        if name != want_name:
            raise CheckpointError(
                f"{self.path}: tensors must come in spec order; expected {want_name!r} "
                f"(number {self._next}), got {name!r}"
            )
        dtype = str_to_dtype(want_dtype)
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{self.path}: tensor {name!r} must be a torch.Tensor, got {tensor!r:.100}")
        if tensor.dtype != dtype or tuple(tensor.shape) != want_shape:
            got = f"{tensor.dtype} {tuple(tensor.shape)}"
            raise CheckpointError(f"{self.path}: tensor {name!r} must be {dtype} {want_shape}, got {got}")
        if tensor.device.type != "cpu":
            raise CheckpointError(f"{self.path}: tensor {name!r} is on {tensor.device}; move it to CPU first")
        assert self._pos == self._offsets[name][0], (self._pos, self._offsets[name])
        data = tensor.detach().resolve_conj().resolve_neg().contiguous()
        view = byte_view(data)
        digest = new_digest() if self._checksums else None
        # Block by block, each hashed just before it is written: the write then copies bytes
        # the hash has just brought into the CPU cache, so the hash costs ~1/20 of the copy.
        for start in range(0, len(view), _WRITE_BLOCK):
            block = view[start:start + _WRITE_BLOCK]
            if digest is not None:
                digest.update(block)
            self._out.write(block)
            self._pos += len(block)
        if digest is not None:
            self.checksums[name] = digest.hexdigest()
        self._next += 1

    def close(self) -> None:
        """Check every tensor was written, then commit the file (durable, then in place)."""
        if self._out is None:
            return
        if self._next != len(self._specs):
            missing = self._specs[self._next][0]
            self.abort()
            raise CheckpointError(
                f"{self.path}: closed with {len(self._specs) - self._next} of {len(self._specs)} "
                f"tensors unwritten (first: {missing!r}); the partial file was removed"
            )
        out, self._out = self._out, None
        try:
            out.commit()
        finally:
            out.abort()
        record_checksums(self.checksums)

    def abort(self) -> None:
        """Drop the partial file; safe to call more than once."""
        if self._out is not None:
            out, self._out = self._out, None
            out.abort()


# --- sharding plan -------------------------------------------------------------------------

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string like ``"5GB"`` (10**9) or ``"1GiB"`` (2**30).

    >>> parse_size("5GB"), parse_size("1GiB"), parse_size(512)
    (5000000000, 1073741824, 512)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = _SIZE_RE.fullmatch(size) if isinstance(size, str) else None
        unit = match.group(2) if match else ""
        if match is None or unit.upper() not in _UNITS or unit.endswith("b"):
            raise CheckpointError(
                f"size {size!r} is not understood; write bytes as an int or a string such as "
                "'500MB', '5GB' (powers of 1000) or '1GiB' (powers of 1024); a lowercase 'b' would mean bits"
            )
        value = int(Fraction(match.group(1)) * _UNITS[unit.upper()])
    if value < 1:
        raise CheckpointError(f"size {size!r} must be at least 1 byte")
    return value


def plan_files(
    specs: Sequence[Spec], max_shard_size: int | str, prefix: str = "model",
    storages: Mapping[str, tuple[object, int]] | None = None,
) -> list[tuple[str, list[Spec]]]:
    """Group tensors, in order, into files of at most ``max_shard_size`` bytes, split where
    huggingface_hub's ``split_torch_state_dict_into_shards`` (so ``save_pretrained``) splits: a
    tensor above the limit gets a file of its own while the file being filled goes on. Files
    are named as transformers names them. ``storages`` (``{name: (storage id, bytes)}``): tensors
    sharing one storage count it once, at the first, and the others join its file.

    >>> [(f, [s[0] for s in g]) for f, g in plan_files([("a", "F32", (4,)), ("b", "F32", (4,))], 16)]
    [('model-00001-of-00002.safetensors', ['a']), ('model-00002-of-00002.safetensors', ['b'])]
    """
    limit = parse_size(max_shard_size)
    if not prefix or "/" in prefix or "\\" in prefix:
        raise CheckpointError(f"file prefix {prefix!r} must be a plain non-empty file name")
    groups: list[list[Spec]] = []
    current: list[Spec] = []
    size = 0
    seen: set[str] = set()
    first_of: dict[object, str] = {}   # storage id -> the tensor that placed it
    joining: list[tuple[str, Spec]] = []  # (that tensor, a tensor sharing its storage)
    for name, dtype, shape in specs:
        if name in seen:
            raise CheckpointError(f"tensor {name!r} appears twice in the save plan")
        seen.add(name)
        spec = (name, dtype, tuple(shape))
        storage = storages.get(name) if storages else None
        if storage is not None and storage[0] in first_of:
            joining.append((first_of[storage[0]], spec))
            continue
        if storage is not None:
            first_of[storage[0]] = name
        nbytes = storage[1] if storage is not None else spec_nbytes(dtype, shape)
        if nbytes > limit:
            groups.append([spec])
            continue
        if current and size + nbytes > limit:
            groups.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current or not groups:
        groups.append(current)
    for first, spec in joining:
        next(g for g in groups if any(s[0] == first for s in g)).append(spec)
    if len(groups) == 1:
        return [(f"{prefix}.safetensors", groups[0])]
    n = len(groups)
    return [(f"{prefix}-{i:05d}-of-{n:05d}.safetensors", group) for i, group in enumerate(groups, 1)]


def index_json(
    file_plan: Sequence[tuple[str, Sequence[Spec]]], total_size: int, metadata: dict | None = None
) -> dict:
    """The ``*.safetensors.index.json`` content for a :func:`plan_files` result."""
    meta = {"total_size": int(total_size)}
    meta.update({k: v for k, v in (metadata or {}).items() if k != "total_size"})
    weight_map = {name: fname for fname, group in file_plan for name, _, _ in group}
    return {"metadata": meta, "weight_map": weight_map}


# safetensors' serializer orders a file's tensors by dtype (its enum order, descending), then
# by name: following it, a one-file save is byte-identical to save_file(sd, metadata={"format": "pt"}).
_SAVE_FILE_DTYPES = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16",
                     "I16", "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "F4", "BOOL")  # 0.8's F4, F8_E8M0


def header_metadata(metadata) -> dict[str, str]:
    """The ``__metadata__`` of every header: ``{"format": "pt"}`` and the user's ``metadata``
    (strings to strings, else ``CheckpointError``)."""
    metadata = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"metadata must map strings to strings, got {metadata!r:.200}")
    if metadata.get("format", "pt") != "pt":
        raise CheckpointError(f"metadata['format'] is {metadata['format']!r}; a torch safetensors "
                              "checkpoint says 'pt' there, which loaders check; drop the key")
    return {"format": "pt", **metadata}


def save_file_order(spec) -> tuple[int, str]:
    """The sort key of a ``(name, dtype, shape)`` within one file: ``save_file``'s order."""
    name, dtype, _ = spec
    rank = _SAVE_FILE_DTYPES.index(dtype) if dtype in _SAVE_FILE_DTYPES else len(_SAVE_FILE_DTYPES)
    return rank, name


def plan_checkpoint(tensors: Sequence[Spec], *, max_shard_size: int | str, prefix: str,
                    metadata: Mapping[str, str] | None = None, index_metadata: Mapping | None = None,
                    storages: Mapping[str, tuple[object, int]] | None = None,
                    parts: Mapping | None = None) -> WritePlan:
    """The plan of a safetensors checkpoint of ``tensors`` (``(name, dtype, shape)``, in the
    model's order): files as :func:`plan_files` splits them, each in ``save_file``'s order,
    every header's metadata ``{"format": "pt", **metadata}``, and for several files an index
    with ``total_size``, ``metadata`` and ``index_metadata``. ``parts`` (the hub layout's
    ``{stored name: StoredPart}``) travels with the plan. Pure; raises ``CheckpointError`` for a
    bad size, prefix or metadata.

    >>> plan = plan_checkpoint([("b", "F16", (2,)), ("a", "F32", (2,))], max_shard_size="1GB", prefix="m")
    >>> [(f.name, [name for name, _, _ in f.tensors]) for f in plan.files], plan.index
    ([('m.safetensors', ['a', 'b'])], None)
    """
    header = header_metadata(metadata)
    files = tuple(PlannedFile(fname, tuple(sorted(group, key=save_file_order)))
                  for fname, group in plan_files(tensors, max_shard_size, prefix, storages))
    index = None
    if len(files) > 1:
        total = sum(spec_nbytes(dtype, shape) for _, dtype, shape in tensors)
        content = index_json([(f.name, f.tensors) for f in files], total,
                             {**dict(metadata or {}), **dict(index_metadata or {})})
        index = (prefix + INDEX_SUFFIX, content)
    return WritePlan(files, header, index, dict(parts or {}))


class SafetensorsSink:
    """The ordinary safetensors checkpoint's writer (a ``shardwise.io.sink.FileSink``):
    ``plan(stored)`` is the same on every rank; ``open_file`` streams one planned file."""

    def __init__(self, *, max_shard_size: int | str, prefix: str, metadata: Mapping[str, str] | None,
                 index_metadata: Mapping | None = None,
                 storages: Mapping[str, tuple[object, int]] | None = None):
        self.max_shard_size, self.prefix = max_shard_size, prefix
        self.metadata, self.index_metadata, self.storages = metadata, index_metadata, storages

    def plan(self, stored: Sequence[StoredTensor]) -> WritePlan:
        return plan_checkpoint([s.spec for s in stored],
                               max_shard_size=self.max_shard_size, prefix=self.prefix,
                               metadata=self.metadata, index_metadata=self.index_metadata,
                               storages=self.storages,
                               parts={s.name: s.part for s in stored if s.part is not None})

    def open_file(self, location: Location, tensors: Sequence[Spec],
                  header: Mapping[str, str]) -> StreamingWriter:
        return StreamingWriter(location, tensors, header)


__all__ = [
    "INDEX_SUFFIX", "SafetensorsSink", "StreamingWriter", "header_metadata", "index_json", "parse_size",
    "plan_checkpoint", "plan_files", "read_header", "save_file_order",
]
