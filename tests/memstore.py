"""A Storage that is not the local filesystem, shared by spawned ranks: the shape an object
store has. Objects live in two dicts served by a ``multiprocessing`` manager in the test
process (``serve()``); every rank connects with the address and authkey that come as
``storage_options`` (``register(...)`` in the rank, ``locate("memstore://ckpt", opts)``).

- objects are immutable once committed (a second commit of a key is an error), and only
  become visible (listed, stat-able) at their commit;
- ``map_whole`` / ``map_range`` give None (every box is read), ``list`` is by prefix, a
  folder is a prefix with objects under it;
- a transaction stages under ``.{name}.staging-{token}`` beside the target and publishes
  by copying: the data objects first, the indexes (``*.index.json``, ``.metadata``) last.

Registered with ``shardwise.io.storage.register_storage`` by the tests that use it, never
by the package.
"""

from __future__ import annotations

import json
import secrets
import threading
from multiprocessing.managers import BaseManager, DictProxy

from shardwise.errors import CheckpointError, UsageError
from shardwise.io.storage import Location, register_storage, unregister_storage, write_small

SCHEME = "memstore"
_DATA: dict[str, bytes] = {}  # in the manager's process: key -> bytes
_SIZES: dict[str, int] = {}  # key -> size, set after the data: what is committed
_MARKERS = (".index.json", ".metadata")  # published last


def _data() -> dict:
    return _DATA


def _sizes() -> dict:
    return _SIZES


class _Manager(BaseManager):
    pass


_Manager.register("data", callable=_data, proxytype=DictProxy)
_Manager.register("sizes", callable=_sizes, proxytype=DictProxy)


def serve() -> tuple[_Manager, dict]:
    """Start the store's server; ``(manager, storage_options)`` (shut the manager down after)."""
    authkey = secrets.token_bytes(16)
    manager = _Manager(address=("127.0.0.1", 0), authkey=authkey)
    manager.start()
    return manager, {"address": manager.address, "authkey": authkey}


class MemHandle:
    def __init__(self, store: MemStore, name: str, data: bytes):
        self.store, self.name, self._data = store, name, data

    def size(self) -> int:
        return len(self._data)

    def readinto(self, buf: memoryview, pos: int) -> None:
        if pos + len(buf) > len(self._data):
            raise CheckpointError(f"{self.name}: ends at byte {len(self._data)}, before {pos + len(buf)}; "
                                  "the object is truncated")
        buf[:] = self._data[pos:pos + len(buf)]
        self.store.bytes_read += len(buf)

    def read_runs(self, buf: memoryview, base: int, runs) -> int:
        pos = 0
        for offset, length in runs:
            self.readinto(buf[pos:pos + length], base + offset)
            pos += length
        return pos

    def map_whole(self):
        return None

    def map_range(self, start: int, length: int):
        return None

    def close(self) -> None:
        self.store.closed += 1


class MemWriter:
    def __init__(self, store: MemStore, key: str):
        self.store, self.key, self.buf = store, key, bytearray()

    def write(self, buf: memoryview) -> None:
        self.buf += buf

    def pwrite(self, buf: memoryview, pos: int) -> None:
        end = pos + len(buf)
        if end > len(self.buf):
            self.buf += bytes(end - len(self.buf))
        self.buf[pos:end] = buf

    def commit(self) -> None:
        self.store.put(self.key, bytes(self.buf))

    def abort(self) -> None:
        self.buf = bytearray()


class MemTransaction:
    def __init__(self, store: MemStore, target: Location, overwrite: bool):
        self.store, self.target, self.overwrite = store, target, overwrite
        self.folder: Location | None = None

    def prepare(self) -> None:
        if self.store.keys_under(self.target) and not self.overwrite:
            raise CheckpointError(f"{self.target} already exists; pass overwrite=True to replace it")
        self.folder = self.target.parent / f".{self.target.name}.staging-{secrets.token_hex(4)}"

    def commit(self, index: tuple[str, dict] | None) -> None:
        assert self.folder is not None, "commit before prepare"
        if index is not None:
            text = json.dumps(index[1], indent=2, sort_keys=True) + "\n"
            write_small(self.folder / index[0], text.encode())
        staged = self.store.keys_under(self.folder)
        for key in self.store.keys_under(self.target):  # overwrite: the previous one goes now
            self.store.delete(key)
        prefix, dest = _key(self.folder) + "/", _key(self.target) + "/"
        for key in sorted(staged, key=lambda k: k.endswith(_MARKERS)):  # the indexes last
            self.store.put(dest + key[len(prefix):], self.store.get(key))
        self.discard()

    def discard(self) -> None:
        if self.folder is not None:
            for key in self.store.keys_under(self.folder):
                self.store.delete(key)
            self.folder = None


def _key(location: Location) -> str:
    return location.path.as_posix()


class MemStore:
    """The :class:`~shardwise.io.storage.Storage` over the served dicts."""

    def __init__(self, address, authkey: bytes):
        self.address, self.authkey = tuple(address), authkey
        manager = _Manager(address=self.address, authkey=authkey)
        manager.connect()
        self._data, self._sizes = manager.data(), manager.sizes()
        self._lock = threading.Lock()
        self.bytes_read = self.closed = 0  # this process's, for the tests

    # the object-level calls the handles and transactions use
    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            if self._sizes.get(key) is not None:
                raise CheckpointError(f"{SCHEME}://{key}: objects are immutable once committed")
            self._data[key] = data
            self._sizes[key] = len(data)

    def get(self, key: str) -> bytes:
        return self._data[key]

    def delete(self, key: str) -> None:
        with self._lock:
            self._sizes.pop(key, None)
            self._data.pop(key, None)

    def keys_under(self, location: Location) -> list[str]:
        prefix = _key(location) + "/"
        return [k for k in self._sizes.keys() if k.startswith(prefix)]

    # the Storage protocol
    def open(self, location: Location) -> MemHandle:
        if self._sizes.get(_key(location)) is None:
            raise CheckpointError(f"{location}: no such object")
        return MemHandle(self, str(location), self._data[_key(location)])

    def stat(self, location: Location) -> int | None:
        return self._sizes.get(_key(location))

    def list(self, location: Location) -> list[str]:
        prefix = _key(location) + "/"
        return sorted({k[len(prefix):].split("/")[0] for k in self.keys_under(location)})

    def is_folder(self, location: Location) -> bool:
        return bool(self.keys_under(location))

    def check_inside(self, root: Location, location: Location, *, source: Location) -> None:
        pass  # no links

    def create(self, location: Location, *, existing: bool = False) -> MemWriter:
        if existing:
            raise UsageError(f"{location}: objects are written whole, not in place")
        return MemWriter(self, _key(location))

    def transaction(self, target: Location, *, overwrite: bool, replaceable=()) -> MemTransaction:
        return MemTransaction(self, target, overwrite)


_STORES: dict = {}


def register() -> None:
    """Serve ``memstore://`` in this process (``storage_options``: ``address``, ``authkey``);
    one connection per address."""
    def factory(address, authkey: bytes) -> MemStore:
        key = (tuple(address), authkey)
        if key not in _STORES:
            _STORES[key] = MemStore(address, authkey)
        return _STORES[key]

    register_storage(SCHEME, factory)


def unregister() -> None:
    unregister_storage(SCHEME)
    _STORES.clear()


__all__ = ["MemStore", "SCHEME", "register", "serve", "unregister"]
