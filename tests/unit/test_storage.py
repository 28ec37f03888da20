"""The storage seam: a second Storage, in memory and defined here, serves the safetensors
writer and readers (headers, boxes on the region reader's threads, whole small files, a
torch.load through HandleFile) and a save transaction, with nothing reaching the disk.

What it does not show yet: ``sw.load`` / ``sw.save`` / DCP over a ``mem://`` location end to
end (the public entry points still decode a location into a local ``Path``).
"""

from __future__ import annotations

import io
import os
from contextlib import closing
from pathlib import Path

import pytest
import torch

from shardwise.core.spec import ShardSpec, split
from shardwise.errors import CheckpointError, UsageError
from shardwise.io.formats.safetensors.files import StreamingWriter, read_header
from shardwise.io.formats.safetensors.reader import RegionReader, plan_reads
from shardwise.io.storage import (
    HandleFile,
    Handles,
    read_json,
    register_storage,
    storage_for,
    unregister_storage,
    write_small,
)
from shardwise.io.storage.local import LOCAL


class MemHandle:
    def __init__(self, store: MemStorage, key: str):
        self.store, self.name, self._data = store, key, store.objects[key]

    def size(self) -> int:
        return len(self._data)

    def readinto(self, buf: memoryview, pos: int) -> None:
        if pos + len(buf) > len(self._data):
            raise CheckpointError(f"{self.name}: ends at {len(self._data)}; truncated")
        buf[:] = self._data[pos:pos + len(buf)]
        self.store.bytes_read += len(buf)

    def read_runs(self, buf: memoryview, base: int, runs) -> int:
        pos = 0
        for offset, length in runs:
            self.readinto(buf[pos:pos + length], base + offset)
            pos += length
        return pos

    def map_whole(self):
        return None  # no views: every box is read

    def map_range(self, start: int, length: int):
        return None

    def close(self) -> None:
        self.store.closed += 1


class MemWriter:
    def __init__(self, store: MemStorage, key: str, existing: bool):
        self.store, self.key = store, key
        self.buf = bytearray(store.objects[key]) if existing else bytearray()
        self.done = False

    def write(self, buf: memoryview) -> None:
        self.buf += buf

    def pwrite(self, buf: memoryview, pos: int) -> None:
        self.buf[len(self.buf):pos + len(buf)] = bytes(max(0, pos + len(buf) - len(self.buf)))
        self.buf[pos:pos + len(buf)] = buf

    def commit(self) -> None:
        self.store.objects[self.key] = bytes(self.buf)
        self.done = True

    def abort(self) -> None:
        pass


class MemTransaction:
    def __init__(self, store: MemStorage, target: Path, overwrite: bool):
        self.store, self.target, self.overwrite = store, target, overwrite
        self.folder: Path | None = None

    def prepare(self) -> None:
        if self.store.list(self.target) and not self.overwrite:
            raise CheckpointError(f"{self.target} exists; pass overwrite=True")
        self.folder = self.target.with_name(f".{self.target.name}.tmp")

    def commit(self, index) -> None:
        assert self.folder is not None
        if index is not None:
            write_small(self.store, self.folder / index[0], repr(index[1]).encode())
        staged = {k: v for k, v in self.store.objects.items() if k.startswith(f"{self.folder}/")}
        for k in [k for k in self.store.objects if k.startswith(f"{self.target}/")]:
            del self.store.objects[k]
        for k, v in staged.items():
            del self.store.objects[k]
            self.store.objects[f"{self.target}/{k.rpartition('/')[2]}"] = v
        self.folder = None

    def discard(self) -> None:
        if self.folder is not None:
            for k in [k for k in self.store.objects if k.startswith(f"{self.folder}/")]:
                del self.store.objects[k]
            self.folder = None


class MemStorage:
    """Objects in a dict, keyed by their location's text."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.bytes_read = self.closed = 0

    def open(self, location: Path) -> MemHandle:
        if str(location) not in self.objects:
            raise CheckpointError(f"{location}: no such object")
        return MemHandle(self, str(location))

    def stat(self, location: Path) -> int | None:
        data = self.objects.get(str(location))
        return None if data is None else len(data)

    def list(self, location: Path) -> list[str]:
        prefix = f"{location}/"
        return sorted(k[len(prefix):] for k in self.objects if k.startswith(prefix))

    def create(self, location: Path, *, existing: bool = False) -> MemWriter:
        return MemWriter(self, str(location), existing)

    def transaction(self, target: Path, *, overwrite: bool) -> MemTransaction:
        return MemTransaction(self, Path(target), overwrite)


@pytest.fixture
def mem(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative locations: anything that bypasses the store lands here
    store = MemStorage()
    register_storage("memtest", lambda **_: store)
    yield store
    unregister_storage("memtest")
    assert list(tmp_path.iterdir()) == [], "bytes bypassed the storage onto the disk"


def test_the_scheme_registry_picks_the_storage_from_the_location(mem):
    assert storage_for("memtest://bucket/ckpt") is mem
    assert storage_for("ckpt/") is LOCAL and storage_for(Path("/tmp/x")) is LOCAL
    with pytest.raises(UsageError, match="memtest"):
        storage_for("nope://bucket")  # the error lists what is registered
    with pytest.raises(UsageError, match="taken"):
        register_storage("memtest", MemStorage)


def test_a_memory_storage_serves_the_writer_and_the_threaded_reader(mem):
    tensors = {"rows": torch.arange(96.0).reshape(24, 4),
               "cols": torch.arange(6 * 16, dtype=torch.int32).reshape(6, 16)}
    path = Path("ckpt/model.safetensors")
    names = {torch.float32: "F32", torch.int32: "I32"}
    specs = [(n, names[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    with StreamingWriter(path, specs, storage=mem) as writer:
        for name, t in tensors.items():
            writer.write(name, t)
    assert mem.list(Path("ckpt")) == ["model.safetensors"] and writer.checksums.keys() == tensors.keys()
    header = read_header(path, storage=mem)
    plan = {"rows": ShardSpec(dim=0), "cols": ShardSpec(dim=1)}
    for rank in range(2):
        mem.bytes_read = 0
        items = plan_reads({n: (path, header.entries[n]) for n in tensors}, plan, 2, rank)
        with RegionReader({path: header}, num_threads=2, storage=mem) as reader:
            got = reader.read(items, finalize=lambda item, raw: raw)
        for name, t in tensors.items():
            assert torch.equal(got[name], split(t, plan[name], 2, rank)), (name, rank)
        assert mem.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values()) // 2


def test_a_torch_load_reads_through_a_handle_file(mem):
    buf = io.BytesIO()
    torch.save(torch.arange(10), buf)
    write_small(mem, Path("blob"), buf.getvalue())
    handles = Handles(mem)
    with closing(HandleFile(handles.get(Path("blob")))) as f:
        assert torch.equal(torch.load(f, weights_only=True), torch.arange(10))
        assert f.pread(4, 0) == buf.getvalue()[:4] and f.tell() > 0
    handles.close()
    assert mem.closed == 1


def test_small_files_and_the_transaction(mem):
    txn = mem.transaction(Path("out"), overwrite=False)
    txn.prepare()
    assert txn.folder is not None
    write_small(mem, txn.folder / "shardwise.json", b'{"version": 1}')
    assert mem.list(Path("out")) == []  # nothing at the target before the commit
    txn.commit(("model.safetensors.index.json", {"weight_map": {}}))
    txn.discard()  # a no-op after the commit
    assert mem.list(Path("out")) == ["model.safetensors.index.json", "shardwise.json"]
    assert read_json(mem, Path("out/shardwise.json"), what="the file") == {"version": 1}
    with pytest.raises(CheckpointError, match="no such object"):
        read_json(mem, Path("out/missing.json"), what="the file")


def test_the_local_storage_is_a_storage_too(tmp_path):
    write_small(LOCAL, tmp_path / "a.json", b'{"x": 1}')
    assert read_json(LOCAL, tmp_path / "a.json", what="the file") == {"x": 1}
    assert LOCAL.list(tmp_path) == ["a.json"] and LOCAL.stat(tmp_path / "a.json") == 8
    assert LOCAL.stat(tmp_path / "b") is None and LOCAL.list(tmp_path / "b") == []
    assert [n for n in os.listdir(tmp_path) if n.endswith(".partial")] == []
