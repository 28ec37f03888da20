"""The storage-level tests' door to the Location-taking helpers: ``at(storage, where)`` is the
Location of ``where`` (``bucket/key``, ``scheme://bucket/key``, a path, or a Location) in
``storage``; ``read_small`` / ``write_small`` take the storage and such a ``where``."""

from __future__ import annotations

from pathlib import PurePosixPath

from shardwise.io.storage import Location
from shardwise.io.storage import read_small as _read_small
from shardwise.io.storage import write_small as _write_small


def at(storage, where) -> Location:
    if isinstance(where, Location):
        return where
    scheme, sep, rest = str(where).partition("://")
    if not sep:
        scheme, rest = storage.scheme, str(where)
    return Location(storage, PurePosixPath(rest), scheme)


def read_small(storage, where, **options) -> bytes:
    return _read_small(at(storage, where), **options)


def write_small(storage, where, data: bytes) -> None:
    _write_small(at(storage, where), data)
