"""``shardwise.json``: what shardwise records beside a checkpoint, and the tensor checksums.

Every checkpoint shardwise writes carries one: a distributed save records its layout (plan,
mesh, degree, dtypes; informational) and one checksum per saved chunk; a gather save or a
consolidation records one checksum per tensor. The checksum is CRC-32 (``zlib.crc32``) of
the tensor's bytes in C order, as 8 hex digits: the cheapest hash the standard library
has (2-4 GB/s on one core of the test machine, against 0.7 for blake2b and 0.5 for md5),
computed on a helper thread while the same bytes are written, and enough to catch a flipped
byte or a torn write; it is no defence against tampering.

The file is read like any other checkpoint input: a regular file inside the folder, at
most 100 MB, strict JSON, every field it has of the type it should be.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import torch

from shardwise.core.header import MAX_HEADER_SIZE, parse_json_object
from shardwise.errors import CheckpointError

INFO_FILE = "shardwise.json"
ALGORITHM = "crc32"
# Below this, a checksum is cheaper inline than handed to the helper thread.
_INLINE_BYTES = 1 << 20


def crc32_hex(buf, value: int = 0) -> str:
    """The checksum text of ``buf`` (a bytes-like object), continuing from ``value``."""
    return f"{zlib.crc32(buf, value):08x}"


def tensor_crc(t: torch.Tensor) -> str:
    """The checksum text of ``t``'s bytes in C order (through a copy only when it is not
    contiguous, held here while it is read: a byte view does not keep its tensor alive)."""
    from shardwise.io.safetensors_io import byte_view

    data = t.detach().resolve_conj().resolve_neg().cpu().contiguous()
    return crc32_hex(byte_view(data))


class Hasher:
    """Checksums computed on one helper thread while the caller writes the same bytes.

    zlib.crc32 releases the GIL, as does ``os.write``, so a checksum submitted just
    before a write runs beside it and costs little wall time where a core is free (its CPU
    time, about 0.25-0.5 s per GB, shows where none is). Whoever submits keeps the memory
    alive until :meth:`result` (or :meth:`close`) returns.
    """

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, buf) -> Future | str:
        """Start the checksum of ``buf``; :meth:`result` turns the handle into its text."""
        if len(buf) < _INLINE_BYTES:
            return crc32_hex(buf)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardwise-crc")
        return self._pool.submit(crc32_hex, buf)

    def submit_tensor(self, t: torch.Tensor) -> Future | str:
        """Start the checksum of ``t``'s bytes in C order (made contiguous on the helper thread)."""
        if t.numel() * t.element_size() < _INLINE_BYTES:
            return tensor_crc(t)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardwise-crc")
        return self._pool.submit(tensor_crc, t)  # the caller keeps t alive until the result

    @staticmethod
    def result(handle: Future | str) -> str:
        return handle if isinstance(handle, str) else handle.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


_SINK: ContextVar[dict[str, str] | None] = ContextVar("shardwise_checksums", default=None)


@contextmanager
def collect_checksums() -> Iterator[dict[str, str]]:
    """``{tensor name: checksum}`` of every file a :class:`StreamingWriter` completes (closes)
    inside the block, on this thread; how a save learns what its writers computed."""
    sums: dict[str, str] = {}
    token = _SINK.set(sums)
    try:
        yield sums
    finally:
        _SINK.reset(token)


def record_checksums(sums: dict[str, str]) -> None:
    """Called by a writer once its file is complete (see :func:`collect_checksums`)."""
    sink = _SINK.get()
    if sink is not None:
        sink.update(sums)


def chunk_key(offsets) -> str:
    """How a DCP chunk is named among a tensor's checksums: its offsets, comma-separated."""
    return ",".join(str(int(o)) for o in offsets)


def write_info(folder: Path, info: dict) -> None:
    """Write ``shardwise.json`` into ``folder`` (aside, fsynced, then renamed)."""
    tmp = folder / (INFO_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / INFO_FILE)


def gather_info(checksums: dict[str, str], specs=None) -> dict:
    """The ``shardwise.json`` of a safetensors checkpoint: each tensor's checksum
    (``{name: checksum}``) and, given ``specs`` (``(name, dtype, shape)`` triples), its dtype
    and shape. Sorted by name, so that the same tensors give the same bytes however written."""
    info: dict = {"format": "shardwise-safetensors", "version": 1}
    if specs is not None:
        info["tensors"] = {name: {"dtype": dtype, "shape": list(shape)}
                           for name, dtype, shape in sorted(specs)}
    info["checksums"] = {"algorithm": ALGORITHM, "tensors": dict(sorted(checksums.items()))}
    return info


# --- reading -------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str_map(v) -> bool:
    return isinstance(v, dict) and all(isinstance(x, str) for x in (*v.keys(), *v.values()))


def _hex_map(v) -> bool:
    return _str_map(v) and all(len(x) == 8 and all(c in "0123456789abcdef" for c in x)
                               for x in v.values())


# field -> (what it must be, check); a field that is absent is fine.
_FIELDS = {
    "format": ("a string", lambda v: isinstance(v, str)),
    "version": ("an int", _is_int),
    "kind": ("a string", lambda v: isinstance(v, str)),
    "shardwise": ("a string", lambda v: isinstance(v, str)),
    "torch": ("a string", lambda v: isinstance(v, str)),
    "world_size": ("an int", _is_int),
    "degree": ("an int", _is_int),
    "holding": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "sharded_axes": ("a list of strings",
                     lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "plan": ("an object of strings", _str_map),
    "metadata": ("an object of strings", _str_map),
    "index_metadata": ("an object of ints and strings", lambda v: isinstance(v, dict) and all(
        isinstance(x, str) or _is_int(x) for x in v.values())),
    "mesh": ("null or {axes: [str], shape: [int]}", lambda v: v is None or (
        isinstance(v, dict) and isinstance(v.get("axes"), list) and isinstance(v.get("shape"), list)
        and all(isinstance(a, str) for a in v["axes"]) and all(_is_int(s) for s in v["shape"]))),
    "tensors": ("an object of {dtype, shape}", lambda v: isinstance(v, dict) and all(
        isinstance(t, dict) and isinstance(t.get("dtype"), str) and isinstance(t.get("shape"), list)
        for t in v.values())),
    "checksums": ("{algorithm: 'crc32', tensors: {name: hex} or chunks: {name: {offsets: hex}}}",
                  lambda v: isinstance(v, dict) and v.get("algorithm") == ALGORITHM and (
                      _hex_map(v.get("tensors")) if "tensors" in v else
                      isinstance(v.get("chunks"), dict) and all(_hex_map(c) for c in v["chunks"].values()))),
}


def read_info(folder: str | os.PathLike) -> dict | None:
    """The validated ``shardwise.json`` of the checkpoint folder ``folder``; None when absent.

    Raises :class:`CheckpointError` naming the file and the fault when it is not a regular
    file inside the folder, is over 100 MB, is not a JSON object, or has a field of the
    wrong type. (It never blocks: a FIFO is refused, not opened for reading.)
    """
    from shardwise.io.checkpoint import check_inside
    from shardwise.io.safetensors_io import _open_regular, _pread_into

    folder = Path(folder)
    path = folder / INFO_FILE
    if not os.path.lexists(path):
        return None
    check_inside(folder, path, source=path)
    fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_HEADER_SIZE:
            raise CheckpointError(f"{path}: {size} bytes, over the {MAX_HEADER_SIZE}-byte cap")
        raw = bytearray(size)
        _pread_into(fd, memoryview(raw), 0, what=str(path))
    finally:
        os.close(fd)
    info = parse_json_object(bytes(raw), source=str(path), what="the file")
    for key, (want, ok) in _FIELDS.items():
        if key in info and not ok(info[key]):
            raise CheckpointError(
                f"{path}: field {key!r} must be {want}, got {info[key]!r:.200}; the file is corrupt "
                f"(it only describes the checkpoint: delete it to go on without its checks)")
    return info


def recorded_checksums(info: dict | None) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """``(per tensor, per DCP chunk)`` checksums recorded in ``info`` (empty when none)."""
    sums = (info or {}).get("checksums") or {}
    return dict(sums.get("tensors") or {}), dict(sums.get("chunks") or {})


__all__ = ["ALGORITHM", "Hasher", "INFO_FILE", "chunk_key", "collect_checksums", "crc32_hex",
           "gather_info", "read_info", "record_checksums", "recorded_checksums", "tensor_crc",
           "write_info"]
