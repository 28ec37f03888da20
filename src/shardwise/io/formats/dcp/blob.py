"""One DCP chunk's blob (what ``torch.save`` writes of one tensor: a zip of ``data.pkl``,
``byteorder`` and one ``data/<key>`` record) read as a description without ``torch.load``:
the zip's central directory, the pickle through an allow-list of the five names a plain tensor's
pickle holds, the data record's offset. ``torch.load`` to a meta tensor cost ~0.7-1.1 ms a chunk
(its zip reader over a file view, its weights-only unpickler in Python), half of a consolidate's
CPU; this ~20 µs. Anything else (compressed or zip64 records, several storages, a tensor with
metadata or another rebuild function, big-endian data) answers None: the caller then asks
``torch.load``, which reads what torch reads, exactly."""

from __future__ import annotations

import collections
import functools
import io
import pickle
import struct
import sys
import zlib

import torch

_EDGE = 4096  # bytes read at each end of a blob: its small records, its central directory
_LOCAL, _CENTRAL, _END = b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06"


def read_blob(f, offset: int, length: int) -> tuple[torch.Tensor, int] | None:
    """``(meta tensor, offset of its storage's data in the blob)`` of the plain tensor blob at
    ``[offset, offset + length)`` of ``f`` (a file with ``pread(n, pos)``, or seek and read);
    None where the blob is not one plain tensor in stored (uncompressed) zip records."""
    head = _pread(f, min(length, _EDGE), offset)
    tail = head if length <= _EDGE else _pread(f, _EDGE, offset + length - _EDGE)
    records = _central_directory(tail, length)
    if records is None or sum(name.startswith("data/") for name in records) != 1:
        return None

    def record(name: str) -> tuple[int, int] | None:  # (data offset in the blob, size)
        at, size, _ = records[name]
        local = head[at:at + 30] if at + 30 <= len(head) else _pread(f, 30, offset + at)
        if len(local) < 30 or local[:4] != _LOCAL:
            return None
        names, extra = struct.unpack_from("<HH", local, 26)
        return at + 30 + names + extra, size

    def content(name: str) -> bytes | None:
        place = record(name) if name in records else None
        if place is None:
            return None
        at, size = place
        data = head[at:at + size] if at + size <= len(head) else _pread(f, size, offset + at)
        return data if zlib.crc32(data) == records[name][2] else None

    if content("byteorder") != sys.byteorder.encode():
        return None
    described = _unpickle(content("data.pkl"))
    if described is None or f"data/{described[0]}" not in records:
        return None
    key, dtype, numel, storage_offset, size, stride = described
    place, nbytes = record(f"data/{key}"), numel * dtype.itemsize
    if place is None or place[1] != nbytes:
        return None
    meta = torch.empty(0, dtype=dtype, device="meta")
    try:  # set_ checks the view fits its storage, as torch.load's rebuild does
        meta.set_(torch.UntypedStorage(nbytes, device="meta"), storage_offset, size, stride)
    except RuntimeError:
        return None
    return meta, place[0]


def _pread(f, n: int, pos: int) -> bytes:
    if hasattr(f, "pread"):
        return f.pread(n, pos)
    f.seek(pos)
    return f.read(n)


def _central_directory(tail: bytes, length: int) -> dict[str, tuple[int, int, int]] | None:
    """``{record name without the archive folder: (local header offset, size, CRC-32)}`` from the
    zip's end record and central directory in ``tail`` (the blob's last bytes); None where they
    are not there or a record is compressed or in zip64 form."""
    end = tail.rfind(_END)
    if end < 0 or len(tail) - end < 22:
        return None
    count, cd_size, cd_at = struct.unpack_from("<HII", tail, end + 10)
    start = len(tail) - (length - cd_at)  # the directory's place in tail
    if count == 0xFFFF or cd_at == 0xFFFFFFFF or start < 0 or start + cd_size > end:
        return None
    out, pos = {}, start
    for _ in range(count):
        if tail[pos:pos + 4] != _CENTRAL:
            return None
        method, crc, packed, size, names, extra, comment = struct.unpack_from("<H4xIIIHHH", tail, pos + 10)
        (at,) = struct.unpack_from("<I", tail, pos + 42)
        if method != 0 or packed != size or 0xFFFFFFFF in (packed, size, at):
            return None
        name = tail[pos + 46:pos + 46 + names].decode("utf-8", "replace").partition("/")[2]
        out[name] = (at, size, crc)
        pos += 46 + names + extra + comment
    return out


@functools.cache
def _storage_dtypes() -> dict[str, torch.dtype]:
    """``{"BFloat16Storage": torch.bfloat16, ...}``: the legacy storage names torch.save pickles."""
    return {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


class _Rebuilt(tuple):
    """The arguments of ``torch._utils._rebuild_tensor_v2`` as the pickle gives them."""


class _Rebuilt3(tuple):
    """The same of ``_rebuild_tensor_v3`` (dtypes without a legacy storage class: an untyped
    storage counted in bytes, the dtype after the hooks)."""


class _Storage(tuple):
    """A storage class's dtype (None for ``UntypedStorage``), as the pickle names it."""


def _rebuild(*args):
    return _Rebuilt(args)


def _rebuild3(*args):
    return _Rebuilt3(args)


_NAMES = {("torch._utils", "_rebuild_tensor_v2"): _rebuild, ("torch._utils", "_rebuild_tensor_v3"): _rebuild3,
          ("collections", "OrderedDict"): collections.OrderedDict,
          ("torch.storage", "UntypedStorage"): _Storage((None,))}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = _NAMES.get((module, name))
        if found is None and module == "torch":  # a legacy storage class, or a dtype
            dtype = _storage_dtypes().get(name) or getattr(torch, name, None)
            found = _Storage((dtype,)) if name in _storage_dtypes() else dtype
            found = found if isinstance(found, (_Storage, torch.dtype)) else None
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not in a plain tensor's pickle")
        return found

    def persistent_load(self, pid):
        return pid


def _unpickle(data: bytes | None) -> tuple | None:
    """``(storage key, dtype, storage numel, storage offset, size, stride)`` of a plain tensor's
    ``data.pkl``, or None for anything else."""
    if data is None:
        return None
    try:
        obj = _Unpickler(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - not a plain tensor's pickle: torch.load reads it (or says why not)
        return None
    if type(obj) is _Rebuilt and len(obj) == 6:
        (pid, storage_offset, size, stride, requires_grad, hooks), dtype = obj, None
    elif type(obj) is _Rebuilt3 and len(obj) == 7 and isinstance(obj[6], torch.dtype):
        pid, storage_offset, size, stride, requires_grad, hooks, dtype = obj  # an untyped storage
    else:
        return None
    if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage" and type(pid[1]) is _Storage
            and type(pid[2]) is str and type(pid[4]) is int and type(requires_grad) is bool
            and type(hooks) is collections.OrderedDict and not hooks):
        return None
    if not (type(size) is tuple and type(stride) is tuple and len(size) == len(stride)
            and all(type(i) is int for i in (storage_offset, *size, *stride))):
        return None
    (stored,), numel = pid[1], pid[4]
    if dtype is None and stored is not None:  # v2: a typed storage, counted in its elements
        dtype = stored
    elif dtype is not None and stored is None and numel % dtype.itemsize == 0:  # v3: counted in bytes
        numel //= dtype.itemsize
    else:
        return None
    return pid[2], dtype, numel, storage_offset, size, stride
