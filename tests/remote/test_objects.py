"""The object-store Storage over real servers (SeaweedFS's S3 gateway, fake-gcs-server), every
request through the tests' proxy: ranges, coalescing, writes invisible until commit, listing."""

from __future__ import annotations

import os

import pytest
from located import at, read_small, write_small

from shardwise.errors import CheckpointError, UsageError
from shardwise.io.storage import locate
from shardwise.io.storage.lookups import one_look


def _put(storage, loc: str, data: bytes) -> None:
    writer = storage.create(loc)
    try:
        writer.write(memoryview(data))
        writer.commit()
    finally:
        writer.abort()


def test_ranges_read_equal_the_bytes_put(remote):
    storage = remote.storage()
    data = os.urandom(3 << 20 | 12345)
    _put(storage, remote.loc("ckpt/blob.bin"), data)
    handle = storage.open(remote.loc("ckpt/blob.bin"))
    assert handle.size() == len(data) and storage.stat(remote.loc("ckpt/blob.bin")) == len(data)
    for start, length in [(0, 1), (17, 4096), (1 << 20, 2 << 20), (len(data) - 9, 9), (0, len(data))]:
        buf = bytearray(length)
        handle.readinto(memoryview(buf), start)
        assert bytes(buf) == data[start:start + length], (start, length)
    with pytest.raises(CheckpointError, match="truncated"):
        handle.readinto(memoryview(bytearray(10)), len(data) - 5)
    assert handle.map_whole() is None and handle.map_range(0, 10) is None


def test_many_runs_are_coalesced_into_few_requests(remote):
    storage = remote.storage()
    data = os.urandom(2 << 20)
    _put(storage, remote.loc("c/blob"), data)
    handle = storage.open(remote.loc("c/blob"))
    # a colwise slice of a [512, 4096] matrix: one contiguous half, as 512 adjacent row runs
    runs = [(row * 2048, 2048) for row in range(512)]
    remote.proxy.clear()
    buf = bytearray(512 * 2048)
    assert handle.read_runs(memoryview(buf), 4096, runs) == len(buf)
    assert bytes(buf) == data[4096:4096 + len(buf)]
    assert remote.proxy.count("GET") == 1 and remote.proxy.sent() == len(buf)
    # a rowwise slice: every other run; a request never reads more than 1/20 beyond its runs
    runs = [(row * 4096, 2048) for row in range(256)]
    remote.proxy.clear()
    buf = bytearray(256 * 2048)
    handle.read_runs(memoryview(buf), 0, runs)
    assert bytes(buf) == b"".join(data[o:o + n] for o, n in runs)
    assert remote.proxy.sent() <= 1.05 * len(buf), remote.proxy.sent()
    # runs with small gaps merge; the read stays within 1.05x
    runs = [(row * 4200, 4096) for row in range(400)]
    remote.proxy.clear()
    buf = bytearray(400 * 4096)
    handle.read_runs(memoryview(buf), 0, runs)
    assert bytes(buf) == b"".join(data[o:o + n] for o, n in runs)
    assert remote.proxy.count("GET") <= 3 and remote.proxy.sent() <= 1.05 * len(buf)


def test_a_large_read_is_split_into_concurrent_parts(s3):
    storage = s3.storage()
    data = os.urandom(5 << 20)
    _put(storage, s3.loc("big"), data)
    s3.proxy.clear()
    buf = bytearray(len(data))
    storage.open(s3.loc("big")).readinto(memoryview(buf), 0)
    assert bytes(buf) == data and s3.proxy.count("GET") == 5 and s3.proxy.sent() == len(data)


def test_a_write_is_invisible_until_commit_and_gone_after_abort(remote):
    storage = remote.storage()
    writer = storage.create(remote.loc("w/a.bin"))
    writer.write(memoryview(b"x" * 1000))
    assert storage.stat(remote.loc("w/a.bin")) is None and storage.list(remote.loc("w")) == []
    writer.commit()
    writer.abort()  # after commit: nothing
    assert storage.stat(remote.loc("w/a.bin")) == 1000 and storage.list(remote.loc("w")) == ["a.bin"]
    writer = storage.create(remote.loc("w/b.bin"))
    writer.write(memoryview(b"y" * 1000))
    writer.abort()
    writer.abort()
    assert storage.stat(remote.loc("w/b.bin")) is None and storage.list(remote.loc("w")) == ["a.bin"]


def test_a_multipart_upload_is_invisible_until_commit_and_aborted(s3):
    storage = s3.storage()
    data = os.urandom((15 << 20) + 77)  # three full 5 MiB parts (S3's smallest) and a short one
    writer = storage.create(s3.loc("m/big.bin"))
    for i in range(0, len(data), 3_000_000):
        writer.write(memoryview(data[i:i + 3_000_000]))
    assert storage.stat(s3.loc("m/big.bin")) is None
    writer.commit()
    assert s3.proxy.count("POST", "uploads") >= 1 and s3.proxy.count("PUT", "partNumber") >= 3
    assert read_small(storage, s3.loc("m/big.bin"), what="it", cap=len(data)) == data
    s3.proxy.clear()
    writer = storage.create(s3.loc("m/gone.bin"))
    writer.write(memoryview(data))
    writer.abort()
    assert storage.stat(s3.loc("m/gone.bin")) is None
    assert s3.proxy.count("POST", "uploads") == 1 and s3.proxy.count("DELETE", "uploadId") == 1


def test_list_stat_and_small_objects(remote):
    storage = remote.storage()
    for name in ("ckpt/b.json", "ckpt/a.safetensors", "ckpt/sub/c", "ckpt2/x"):
        write_small(storage, remote.loc(name), b"{}")
    assert storage.list(remote.loc("ckpt")) == ["a.safetensors", "b.json", "sub"]
    assert storage.list(remote.loc("nothing")) == [] and storage.stat(remote.loc("ckpt/none")) is None
    with pytest.raises(CheckpointError, match="no such object"):
        storage.open(remote.loc("ckpt/none"))
    assert read_small(storage, remote.loc("ckpt/b.json"), what="it") == b"{}"


def test_inside_one_look_the_store_is_asked_each_question_once(remote):
    storage, names = remote.storage(), ["a.bin", "b.bin", "c.bin"]
    for name in names:
        _put(storage, remote.loc(f"ckpt/{name}"), name.encode() * 100)
    folder = at(storage, remote.loc("ckpt"))

    def look() -> int:  # what a load asks: the listing, each object's size, then opens
        remote.proxy.clear()
        for _ in range(2):
            assert folder.list() == names and folder.is_folder()
            assert [(folder / n).stat() for n in names] == [500] * 3
            assert [(folder / n).open().size() for n in names] == [500] * 3
        return len(remote.proxy.requests)

    assert look() >= 2 * 4 * len(names)  # unscoped: a journal HEAD and a HEAD per open and stat
    with one_look():
        assert look() == 2  # the journal beside the folder (absent) and one listing with the sizes


def test_an_object_replaced_after_the_look_fails_its_read(remote):
    storage = remote.storage()
    _put(storage, remote.loc("r/x.bin"), b"1" * 1000)
    folder = at(storage, remote.loc("r"))
    with one_look():
        assert folder.list() == ["x.bin"]
        _put(storage, remote.loc("r/x.bin"), b"2" * 1000)
        handle = (folder / "x.bin").open()  # its length and ETag from the listing: the old ones
        with pytest.raises(CheckpointError, match="replaced while being read"):
            handle.readinto(memoryview(bytearray(10)), 0)
    buf = bytearray(10)
    (folder / "x.bin").open().readinto(memoryview(buf), 0)  # a new look: the new object
    assert bytes(buf) == b"2" * 10


def test_positional_writes_are_refused(remote):
    storage = remote.storage()
    with pytest.raises(UsageError, match="parallel_write"):
        storage.create(remote.loc("p/file"), existing=True)
    writer = storage.create(remote.loc("p/file"))
    with pytest.raises(UsageError, match="offset"):
        writer.pwrite(memoryview(b"x"), 10)
    writer.abort()


def test_the_scheme_registry_serves_urls_from_the_environment(remote, monkeypatch):
    if remote.scheme == "s3":
        for k, v in {"AWS_ENDPOINT_URL": remote.proxy.endpoint,
                     "AWS_ACCESS_KEY_ID": remote.options["access_key_id"],
                     "AWS_SECRET_ACCESS_KEY": remote.options["secret_access_key"],
                     "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}.items():
            monkeypatch.setenv(k, v)
    storage = locate(remote.url("e")).storage
    assert storage is locate(remote.url("f")).storage  # one storage (and its clients) per configuration
    write_small(storage, remote.url("e/one"), b"1")
    assert storage.list(remote.url("e")) == ["one"] and storage.stat(remote.loc("e/one")) == 1
