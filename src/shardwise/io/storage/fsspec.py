"""Any filesystem fsspec knows (``memory://``, ``hf://``, ``https://``, ``file://``, ...) as a
:class:`~shardwise.io.storage.Storage`, for the URL schemes no shardwise storage registers:
:func:`~shardwise.io.storage.locate` falls back here, and fsspec is imported only then.

A location is a Location whose path is the URL without its scheme (``ckpt/out`` for
``memory://ckpt/out``); fsspec is handed the whole URL. Configured by the filesystem's own
variables or ``storage_options=`` (its constructor's keyword arguments, plus ``part_size``,
``concurrency``, ``retries``, as for ``s3://``).

Reads: ranged, never a whole object for a slice: through the filesystem's ``cat_file(path,
start, end)`` where it has its own (``http``, ``memory``), else through a file opened
without read-ahead (``hf``'s and the other buffered files); a batch of runs is coalesced and
issued concurrently by ``remote.RemoteFile``, as for ``s3://`` (this client serves its
``get_range``); every body is checked for its length and retried with bounded backoff.
No mapped views. A hub location should name a commit (``hf://org/name@<sha>``), so that
every read sees one version: ``sw.from_pretrained`` pins one.

Writes, where the filesystem writes: objects front to back, a save staged beside the target
and published by ``publish.Publish``'s journal (complete or absent, the same steps as ``s3://``)
over the primitives of :class:`FsspecPublish`. A read-only scheme (:data:`READ_ONLY`) refuses
a save before anything is written. No error shows a configured secret.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Sequence
from typing import Any

from shardwise.errors import CheckpointError, UsageError
from shardwise.io.storage import Location
from shardwise.io.storage.publish import Publish
from shardwise.io.storage.remote import RemoteFile, RemoteStorage, ShortBody, cached

# Schemes a save refuses, and why: what the filesystem calls a write is no checkpoint save.
READ_ONLY = {
    "http": "fsspec's HTTP filesystem has no listing, rename or delete a save can rely on",
    "https": "fsspec's HTTP filesystem has no listing, rename or delete a save can rely on",
    "hf": "each object written to the hub would be a commit of its own; save locally and upload "
          "the folder with huggingface_hub's upload_folder",
}
_TRANSIENT_STATUS = {408, 425, 429, 500, 502, 503, 504}


def _fsspec():
    try:
        import fsspec
    except ImportError as e:
        raise UsageError("URL locations other than s3:// and gs:// are read through fsspec, which is "
                         "not installed: pip install fsspec") from e
    return fsspec


class FsspecStorage(RemoteStorage):
    """The storage of one fsspec filesystem (one scheme, one configuration). Keys are paths
    below the scheme; the ``bucket`` argument of the shared helpers (``lookups.publishing``,
    ``redirect``) is always "". Every method may be called from any thread."""

    secret_variables = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
    name_final = True

    def __init__(self, scheme: str, *, registered: Sequence[str] = (), **options):
        fsspec = _fsspec()
        super().__init__(scheme, options)
        self.read_only = READ_ONLY.get(scheme)  # None: it writes (see target_path)
        try:
            cls = fsspec.get_filesystem_class(scheme)
        except ValueError:
            raise UsageError(f"{scheme}://: no storage for the scheme {scheme!r}: shardwise registers "
                             f"{sorted(registered)} and fsspec knows {sorted(fsspec.available_protocols())}"
                             ) from None
        except ImportError as e:  # fsspec knows it; its implementation needs a package
            raise UsageError(f"{scheme}:// locations are read by fsspec, whose {scheme!r} filesystem is "
                             f"missing a package: {e}") from None
        try:
            self.fs = cls(**options)
        except Exception as e:  # an option the filesystem refuses
            raise UsageError(f"{scheme}://: cannot configure fsspec's {cls.__name__} with "
                             f"storage_options {sorted(options)}: {self.scrub(e)}") from None
        from fsspec.asyn import AsyncFileSystem
        from fsspec.spec import AbstractFileSystem

        # AbstractFileSystem.cat_file reads through a buffered file whose default cache reads a
        # whole block ahead; a filesystem with its own (async ones: a ranged request) is exact
        own = type(self.fs).cat_file is not AbstractFileSystem.cat_file
        self._cat = own or isinstance(self.fs, AsyncFileSystem)
        # a request that can reach the store after its client gave up (lookups.committed): not
        # on the filesystems that run in this process
        self.late_writes = scheme not in ("file", "local", "memory")

    def url(self, bucket: str, key: str) -> str:
        return f"{self.scheme}://{key}"

    def _key(self, location) -> str:
        return location.path.as_posix() if isinstance(location, Location) else str(location)

    # --- the Storage protocol (open, stat, list, is_folder, check_inside: RemoteStorage's) ---

    def split(self, location) -> tuple[str, str]:
        return "", self._key(location).rstrip("/")

    def names(self, bucket: str, key: str) -> builtins.list[str]:
        if self.head("", key) is not None:  # an object, no folder (http's ls would GET it whole)
            return []
        return [name for name, _ in self._entries(key)]

    def create(self, location, *, existing: bool = False) -> FsspecWriter:
        self.check_writable(location)
        self.refuse_existing(location, existing)
        return FsspecWriter(self, self._key(location))

    def transaction(self, target, *, overwrite: bool, replaceable: Sequence[str] = ()) -> FsspecPublish:
        self.check_writable(target)
        return FsspecPublish(self, target, overwrite, tuple(replaceable))

    def check_writable(self, location) -> None:
        if self.read_only:
            raise UsageError(f"{location}: cannot save to {self.scheme}:// ({self.read_only}); save to a "
                             "local folder or a writable storage")

    # --- requests, retried --------------------------------------------------------------

    def make_parent(self, key: str) -> None:
        """Make the folder that will hold ``key`` (local files need one; others make nothing)."""
        parent = self.url("", key.rpartition("/")[0])
        if key.rpartition("/")[0]:
            self.call(lambda: self.fs.makedirs(parent, exist_ok=True), f"making the folder {parent}")

    def _entries(self, key: str) -> builtins.list[tuple[str, str]]:
        """``(name, type)`` of what is directly under the folder ``key``; [] for none."""
        path = self.url("", key)
        found = self.call(lambda: self.fs.ls(path, detail=True), f"listing {path}",
                          absent=(FileNotFoundError, NotADirectoryError), default=[])
        inside = self.fs._strip_protocol(path).rstrip("/")
        return [(str(e["name"]).rstrip("/").rpartition("/")[2], e.get("type", "file")) for e in found
                if self.fs._strip_protocol(str(e["name"])).rstrip("/") != inside]

    def head(self, bucket: str, key: str) -> dict | None:
        """``{"size": n}`` of the object ``key``; None when absent or a folder."""
        path = self.url("", key)
        info = self.call(lambda: self.fs.info(path), f"stat {path}", absent=(FileNotFoundError,))
        if info is None or info.get("type", "file") != "file" or info.get("size") is None:
            return None
        return {"size": int(info["size"])}

    def get_bytes(self, bucket: str, key: str) -> bytes:
        path = self.url("", key)
        return bytes(self.call(lambda: self.fs.cat_file(path), f"reading {path}"))

    def read_range(self, key: str, start: int, end: int, size: int) -> bytes:
        if self._cat:
            return self.fs.cat_file(self.url("", key), start=start, end=end)
        with self.fs.open(self.url("", key), "rb", cache_type="none", size=size) as f:
            f.seek(start)
            return f.read(end - start)

    def get_range(self, file: RemoteFile, start: int, end: int, land) -> None:
        """``RemoteStorage.get_range``: one ranged read, its length checked (no versions here)."""
        key = file.key

        def request():
            data = self.read_range(key, start, end, file.size())
            if len(data) != end - start:
                raise ShortBody(f"{len(data)} bytes for the {end - start}-byte range (the object changed "
                                "under the reader, or the server ignored the Range)")
            return data

        land(0, memoryview(self.call(request, f"reading {file.name} bytes [{start}, {end})")))

    def is_final(self, error: Exception) -> bool:
        """Absent, denied, refused, a 4xx answer."""
        if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
                              NotImplementedError, ValueError, TypeError)):
            return True
        response = getattr(error, "response", None)  # requests / httpx (huggingface_hub's errors)
        status = getattr(response, "status_code", None) or getattr(error, "status", None)  # aiohttp
        return isinstance(status, int) and 400 <= status < 500 and status not in _TRANSIENT_STATUS


class FsspecWriter:
    """A new object written front to back through the filesystem's own writer, complete at
    ``commit`` (its close); ``abort`` drops it. Inside a save it sits in the staging folder,
    which no load reads."""

    def __init__(self, storage: FsspecStorage, key: str):
        self.storage, self.key, self.name = storage, key, storage.url("", key)
        self._file: Any = None
        self._done = False

    def write(self, buf: memoryview) -> None:
        assert not self._done, "write after commit or abort"
        try:
            if self._file is None:
                self.storage.make_parent(self.key)
                self._file = self.storage.fs.open(self.name, "wb")
            self._file.write(buf)
        except OSError as e:
            raise CheckpointError(f"writing {self.name}: {self.storage.scrub(e)}") from None

    def pwrite(self, buf: memoryview, pos: int) -> None:
        raise UsageError(f"{self.name}: fsspec storage cannot write at an offset (pwrite); objects are "
                         "written front to back")

    def commit(self) -> None:
        assert not self._done, "commit after commit or abort"
        self._done = True
        try:
            if self._file is None:  # an empty object
                self.storage.make_parent(self.key)
                self.storage.fs.pipe_file(self.name, b"")
            else:
                self._file.close()
        except OSError as e:
            raise CheckpointError(f"writing {self.name}: {self.storage.scrub(e)}") from None

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        if self._file is not None:
            try:
                self._file.close()
                self.storage.fs.rm_file(self.name)
            except OSError:
                pass  # nothing was made visible, or it is in a staging folder that discard clears


class FsspecPublish(Publish):
    """The save transaction over an fsspec filesystem: ``publish.Publish``'s steps and journal,
    its five primitives served by the filesystem (and a folder cleared whole)."""

    storage: FsspecStorage

    def _objects(self, prefix: str) -> dict[str, int]:
        path = self._url(prefix)
        found = self.storage.call(lambda: self.storage.fs.find(path, detail=True), f"listing {path}",
                                  absent=(FileNotFoundError,), default={})
        inside = self.storage.fs._strip_protocol(path).rstrip("/") + "/"
        return {name[len(inside):]: int(info.get("size") or 0) for name, info in found.items()
                if name.startswith(inside) and info.get("type", "file") == "file"}

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            self.storage.call(lambda k=key: self.storage.fs.rm_file(self._url(k)),
                              f"deleting {self._url(key)}", absent=(FileNotFoundError,))

    def _put(self, key: str, data: bytes) -> None:
        self.storage.make_parent(key)
        self.storage.call(lambda: self.storage.fs.pipe_file(self._url(key), data),
                          f"writing {self._url(key)}")

    def _copy(self, src: str, dst: str) -> None:
        self.storage.make_parent(dst)
        self.storage.call(lambda: self.storage.fs.cp_file(self._url(src), self._url(dst)),
                          f"copying {self._url(src)} to {self._url(dst)}")

    def _clear(self, prefix: str) -> None:
        """Delete the folder ``prefix`` with all under it (a filesystem keeps empty folders)."""
        path = self._url(prefix)
        self.storage.call(lambda: self.storage.fs.rm(path, recursive=True), f"deleting {path}",
                          absent=(FileNotFoundError,))

    def _folders(self, parent: str) -> list[str]:
        return [f"{parent}/{name}" if parent else name
                for name, kind in self.storage._entries(parent) if kind == "directory"]


def factory(scheme: str, *, registered: Sequence[str] = ()):
    """The storage factory of an fsspec ``scheme``: one storage (its filesystem, its pool) per
    distinct options. ``registered``: the schemes shardwise's registry holds, named when fsspec
    knows no ``scheme`` either."""
    def make(**options) -> FsspecStorage:
        key = ("fsspec", scheme, json.dumps(options, sort_keys=True, default=repr))
        return cached(key, lambda: FsspecStorage(scheme, registered=registered, **options))
    return make


__all__ = ["READ_ONLY", "FsspecPublish", "FsspecStorage", "FsspecWriter", "factory"]
