"""``shardwise.json``, written beside every checkpoint: the layout of a distributed save
(informational) and one checksum per tensor (or per DCP chunk), XXH3-64 of the bytes in C
order, computed as written (``zlib.crc32``, recorded before, is still verified). It catches a
flipped byte or a torn write, not tampering. Read as untrusted input: a regular file in the
folder, at most 100 MB, strict JSON, every field of its type."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import xxhash

from shardwise.core.spec import is_int
from shardwise.errors import CheckpointError
from shardwise.io.storage import Location, ReadHandle, byte_view, locate, read_json, write_small

INFO_FILE = "shardwise.json"


class _Crc32:
    """CRC-32 (``zlib.crc32``), what shardwise recorded before xxh3: still verified."""

    def __init__(self):
        self._value = 0

    def update(self, buf) -> None:
        self._value = zlib.crc32(buf, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


# algorithm name (as recorded in shardwise.json) -> (digest factory, hex digits)
DIGESTS = {"xxh3_64": (xxhash.xxh3_64, 16), "crc32": (_Crc32, 8)}
ALGORITHM = "xxh3_64"  # what saves record


def new_digest(algorithm: str = ALGORITHM):
    """A running checksum (``update(buffer)``, ``hexdigest()``) of the named algorithm."""
    if algorithm not in DIGESTS:
        raise CheckpointError(f"unknown checksum algorithm {algorithm!r}; shardwise knows "
                              f"{sorted(DIGESTS)} (a newer shardwise may have written this checkpoint)")
    return DIGESTS[algorithm][0]()


def digest_hex(buf, algorithm: str = ALGORITHM) -> str:
    """The checksum text of ``buf`` (a bytes-like object)."""
    digest = new_digest(algorithm)
    digest.update(buf)
    return digest.hexdigest()


def tensor_checksum(t: torch.Tensor, algorithm: str = ALGORITHM) -> str:
    """The checksum text of ``t``'s bytes in C order (a contiguous copy held while it is read)."""
    data = t.detach().resolve_conj().resolve_neg().cpu().contiguous()
    return digest_hex(byte_view(data), algorithm)


_SINK: ContextVar[dict[str, str] | None] = ContextVar("shardwise_checksums", default=None)


@contextmanager
def collect_checksums() -> Iterator[dict[str, str]]:
    """``{tensor name: checksum}`` of every file a writer completes inside the block, on this
    thread: how a save learns what its writers computed."""
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


def write_info(folder: Location, info: dict) -> None:
    """Write ``shardwise.json`` into ``folder`` (aside, durable, then in place)."""
    write_small(folder / INFO_FILE, (json.dumps(info, indent=1) + "\n").encode())


def gather_info(checksums: dict[str, str], specs) -> dict:
    """The ``shardwise.json`` of a safetensors checkpoint: ``checksums`` and each tensor's dtype
    and shape (``specs``: ``(name, dtype, shape)``); sorted, so the bytes are stable."""
    return {"format": "shardwise-safetensors", "version": 1,
            "tensors": {name: {"dtype": dtype, "shape": list(shape)} for name, dtype, shape in sorted(specs)},
            "checksums": {"algorithm": ALGORITHM, "tensors": dict(sorted(checksums.items()))}}


def digest_range(handle: ReadHandle, start: int, nbytes: int, algorithm: str,
                 piece: int = 16 << 20) -> str:
    """The ``algorithm`` digest of ``nbytes`` bytes of ``handle`` from ``start``, read ``piece``
    bytes at a time; a short object raises ``CheckpointError`` naming it."""
    buf = bytearray(min(piece, max(nbytes, 1)))
    digest, done = new_digest(algorithm), 0
    while done < nbytes:
        view = memoryview(buf)[: min(len(buf), nbytes - done)]
        handle.readinto(view, start + done)
        digest.update(view)
        done += len(view)
    return digest.hexdigest()


# --- reading -------------------------------------------------------------------------------

def _str_map(v) -> bool:
    return isinstance(v, dict) and all(isinstance(x, str) for x in (*v.keys(), *v.values()))


def _hex_map(v, digits: int) -> bool:
    return _str_map(v) and all(len(x) == digits and all(c in "0123456789abcdef" for c in x)
                               for x in v.values())


def _checksums_ok(v) -> bool:
    if not isinstance(v, dict) or v.get("algorithm") not in DIGESTS:
        return False
    digits = DIGESTS[v["algorithm"]][1]
    if "tensors" in v:
        return _hex_map(v["tensors"], digits)
    return isinstance(v.get("chunks"), dict) and all(_hex_map(c, digits) for c in v["chunks"].values())


# field -> (what it must be, check); a field that is absent is fine.
_FIELDS = {
    "format": ("a string", lambda v: isinstance(v, str)),
    "version": ("an int", is_int),
    "kind": ("a string", lambda v: isinstance(v, str)),
    "shardwise": ("a string", lambda v: isinstance(v, str)),
    "torch": ("a string", lambda v: isinstance(v, str)),
    "world_size": ("an int", is_int),
    "degree": ("an int", is_int),
    "holding": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "sharded_axes": ("a list of strings",
                     lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "plan": ("an object of strings", _str_map),
    "metadata": ("an object of strings", _str_map),
    "index_metadata": ("an object of ints and strings", lambda v: isinstance(v, dict) and all(
        isinstance(x, str) or is_int(x) for x in v.values())),
    "mesh": ("null or {axes: [str], shape: [int]}", lambda v: v is None or (
        isinstance(v, dict) and isinstance(v.get("axes"), list) and isinstance(v.get("shape"), list)
        and all(isinstance(a, str) for a in v["axes"]) and all(is_int(s) for s in v["shape"]))),
    "tensors": ("an object of {dtype, shape}", lambda v: isinstance(v, dict) and all(
        isinstance(t, dict) and isinstance(t.get("dtype"), str) and isinstance(t.get("shape"), list)
        for t in v.values())),
    "checksums": (f"{{algorithm: one of {sorted(DIGESTS)}, tensors: {{name: hex}} or "
                  "chunks: {name: {offsets: hex}}}", _checksums_ok),
}


def read_info(folder: Location | str | os.PathLike) -> dict | None:
    """The validated ``shardwise.json`` of ``folder``, None when absent; ``CheckpointError``
    naming the fault (not a regular file inside the folder, too large, not JSON, a bad field)."""
    folder = locate(folder)  # a str or path: the tools' and tests' door
    path = folder / INFO_FILE
    if not path.exists() and path.name not in folder.list():  # a dangling link is refused below
        return None
    folder.storage.check_inside(folder, path, source=path)
    info = read_json(path, what="the file")
    for key, (want, ok) in _FIELDS.items():
        if key in info and not ok(info[key]):
            raise CheckpointError(
                f"{path}: field {key!r} must be {want}, got {info[key]!r:.200}; the file is corrupt "
                f"(it only describes the checkpoint: delete it to go on without its checks)")
    return info


__all__ = ["ALGORITHM", "DIGESTS", "INFO_FILE", "chunk_key", "collect_checksums", "digest_hex",
           "digest_range", "gather_info", "new_digest", "read_info", "record_checksums", "tensor_checksum",
           "write_info"]
