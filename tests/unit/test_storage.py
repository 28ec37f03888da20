"""The storage seam: a second Storage (``tests/memstore.py``: objects in a manager's dicts,
immutable once committed, no mappings) serves the safetensors writer and readers (headers,
boxes on the region reader's threads, whole small files, a torch.load through HandleFile) and
a save transaction, with nothing reaching the disk; ``tests/dist/test_memstore.py`` runs the
public verbs over it on spawned ranks.
"""

from __future__ import annotations

import io
import os
from contextlib import closing
from pathlib import Path

import pytest
import torch

import memstore
import shardwise as sw
from shardwise.core.spec import ShardSpec, split
from shardwise.errors import CheckpointError, UsageError
from shardwise.io.formats.safetensors.files import StreamingWriter, read_header
from shardwise.io.read.reader import RegionReader, plan_reads
from shardwise.io.storage import (
    HandleFile,
    Handles,
    Location,
    locate,
    read_json,
    register_storage,
    write_small,
)
from shardwise.io.storage.local import LOCAL


@pytest.fixture
def mem(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative locations: anything that bypasses the store lands here
    manager, options = memstore.serve()
    memstore.register()
    yield locate("memstore://bucket", options)
    memstore.unregister()
    manager.shutdown()
    assert list(tmp_path.iterdir()) == [], "bytes bypassed the storage onto the disk"


def test_the_scheme_registry_picks_the_storage_from_the_location(mem):
    at = locate("memstore://bucket/ckpt", {"address": mem.storage.address, "authkey": mem.storage.authkey})
    assert at.storage is mem.storage and str(at) == "memstore://bucket/ckpt" and at.scheme == "memstore"
    assert str(at / "model.safetensors") == "memstore://bucket/ckpt/model.safetensors"
    assert at.parent.name == "bucket" and (at / "x.json").suffix == ".json"
    assert locate("ckpt/").storage is LOCAL and locate(Path("/tmp/x")) == Location(LOCAL, Path("/tmp/x"))
    assert locate(at) is at  # a Location passes through
    with pytest.raises(UsageError, match="memstore"):
        locate("nope://bucket")  # the error lists what is registered
    with pytest.raises(UsageError, match="local path"):
        locate("ckpt/", {"address": None})  # options for a local path would be ignored
    with pytest.raises(UsageError, match="taken"):
        register_storage("memstore", memstore.MemStore)
    with pytest.raises(UsageError, match="needs a local path"):
        at.local_path("torch.load")


def test_a_memory_storage_serves_the_writer_and_the_threaded_reader(mem):
    tensors = {"rows": torch.arange(96.0).reshape(24, 4),
               "cols": torch.arange(6 * 16, dtype=torch.int32).reshape(6, 16)}
    path = mem / "ckpt/model.safetensors"
    names = {torch.float32: "F32", torch.int32: "I32"}
    specs = [(n, names[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    with StreamingWriter(path, specs) as writer:
        for name, t in tensors.items():
            writer.write(name, t)
    assert (mem / "ckpt").list() == ["model.safetensors"] and writer.checksums.keys() == tensors.keys()
    header = read_header(path)
    plan = {"rows": ShardSpec(dim=0), "cols": ShardSpec(dim=1)}
    for rank in range(2):
        mem.storage.bytes_read = 0
        items = plan_reads({n: (path, header.entries[n]) for n in tensors}, plan, 2, rank)
        with RegionReader({path: header}, num_threads=2) as reader:
            got = reader.read(items, finalize=lambda item, raw: raw)
        for name, t in tensors.items():
            assert torch.equal(got[name], split(t, plan[name], 2, rank)), (name, rank)
        assert mem.storage.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values()) // 2


def test_a_torch_load_reads_through_a_handle_file(mem):
    buf = io.BytesIO()
    torch.save(torch.arange(10), buf)
    write_small(mem / "blob", buf.getvalue())
    handles = Handles()
    with closing(HandleFile(handles.get(mem / "blob"))) as f:
        assert torch.equal(torch.load(f, weights_only=True), torch.arange(10))
        assert f.pread(4, 0) == buf.getvalue()[:4] and f.tell() > 0
    handles.close()
    assert mem.storage.closed == 1


def test_small_files_and_the_transaction(mem):
    out = mem / "out"
    txn = out.storage.transaction(out, overwrite=False)
    txn.prepare()
    assert txn.folder is not None
    write_small(txn.folder / "shardwise.json", b'{"version": 1}')
    assert out.list() == [] and not out.is_folder()  # nothing at the target before the commit
    txn.commit(("model.safetensors.index.json", {"weight_map": {}}))
    txn.discard()  # a no-op after the commit
    assert out.list() == ["model.safetensors.index.json", "shardwise.json"] and mem.list() == ["out"]
    assert read_json(out / "shardwise.json", what="the file") == {"version": 1}
    with pytest.raises(CheckpointError, match="no such object"):
        read_json(out / "missing.json", what="the file")
    with pytest.raises(CheckpointError, match="immutable"):
        write_small(out / "shardwise.json", b"{}")
    with pytest.raises(CheckpointError, match="already exists"):
        out.storage.transaction(out, overwrite=False).prepare()


def test_the_local_storage_is_a_storage_too(tmp_path):
    root = locate(tmp_path)
    write_small(root / "a.json", b'{"x": 1}')
    assert read_json(root / "a.json", what="the file") == {"x": 1}
    assert root.list() == ["a.json"] and (root / "a.json").stat() == 8 and root.stat() is None
    assert (root / "b").stat() is None and (root / "b").list() == [] and root.is_folder()
    assert [p.name for p in root.glob("*.json")] == ["a.json"]
    assert str(root / "a.json") == str(tmp_path / "a.json")
    assert [n for n in os.listdir(tmp_path) if n.endswith(".partial")] == []


def test_coalesced_requests_are_whole_parts():
    from shardwise.io.storage.remote import coalesce

    # neighbouring runs (tensors of one file) land in requests of exactly part_size bytes: a run
    # that does not fit fills the request and goes on in the next, as a raw ranged GET of the
    # same bytes would cut them; a gap (waste 0) starts a new request
    got = list(coalesce([(0, 5), (5, 10), (15, 3), (30, 4)], 8, waste=0.0))
    assert [(start, end) for start, end, _ in got] == [(0, 8), (8, 16), (16, 18), (30, 34)]
    parts = [part for _, _, parts in got for part in parts]
    assert parts == [(0, 5), (5, 3), (8, 7), (15, 1), (16, 2), (30, 4)]
    # a rowwise slice's every-other runs stay apart beyond the allowed waste
    got = list(coalesce([(0, 2), (4, 2), (8, 2)], 8, waste=0.25))
    assert [(start, end) for start, end, _ in got] == [(0, 2), (4, 6), (8, 10)]


@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors.index.json"])
def test_a_symlink_loop_is_a_checkpoint_error_naming_the_file(tmp_path, name):
    # the fuzzer's one defect: a checkpoint file that is a symlink to itself raised ELOOP
    (tmp_path / name).symlink_to(name)
    for call in (lambda: LOCAL.stat(locate(tmp_path / name)), lambda: LOCAL.open(locate(tmp_path / name)),
                 lambda: sw.inspect(tmp_path), lambda: sw.inspect(tmp_path / name)):
        with pytest.raises(CheckpointError, match=f"{name}: cannot (open|read) \\(Too many levels of"):
            call()
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(CheckpointError, match="loop: cannot read"):
        LOCAL.list(locate(tmp_path / "loop"))
