"""The object-store save transaction over real servers: a save is complete or absent, and the
previous checkpoint at the prefix reads whole, old or new, when the save stops at any step."""

from __future__ import annotations

import json
import os
import time

import pytest
from located import write_small

from shardwise.errors import CheckpointError
from shardwise.io.formats import checkpoint_files
from shardwise.io.storage.lookups import DONE_MARK
from shardwise.io.storage.publish import PUBLISH_MARK

INDEX = "model.safetensors.index.json"


def _version(tag: str) -> dict[str, bytes]:
    """A checkpoint's files (the index aside): two data files, their bytes tagged."""
    return {f"model-0000{i}-of-00002.safetensors": tag.encode() * 1000 + os.urandom(100) for i in (1, 2)}


def _save(storage, target: str, files: dict[str, bytes], *, overwrite=True, stop=None):
    """One save as sw.save runs it (rank 0's transaction, writers into its folder), stopped by
    an exception raised where ``stop`` names ("staged": after the files, before commit)."""
    txn = storage.transaction(target, overwrite=overwrite, replaceable=checkpoint_files())
    try:
        txn.prepare()
        for name, data in files.items():
            write_small(storage, txn.folder / name, data)
        if stop == "staged":
            raise KeyboardInterrupt("killed after staging")
        txn.commit((INDEX, {"weight_map": {n: n for n in files}}))
    finally:
        txn.discard()


def _read(storage, target: str) -> tuple[dict[str, bytes], dict]:
    """What a loader sees at ``target``: every listed file's bytes and the parsed index."""
    names = storage.list(target)
    got = {}
    for name in names:
        handle = storage.open(f"{target}/{name}")
        buf = bytearray(handle.size())
        handle.readinto(memoryview(buf), 0)
        got[name] = bytes(buf)
    index = json.loads(got.pop(INDEX))
    assert sorted(index["weight_map"]) == sorted(got), "the index names exactly the files there"
    return got, index


def _left(remote) -> list[str]:
    """Every object under the test's prefix (a store may list a prefix emptied of objects), but
    the record of committed saves beside a target (it stays: ``lookups.committed``)."""
    import obstore

    store = remote.storage().store(remote.bucket)
    return sorted(o["path"][len(remote.prefix) + 1:] for b in obstore.list(store, prefix=f"{remote.prefix}/")
                  for o in b if not o["path"].endswith(DONE_MARK))


@pytest.mark.parametrize("first", ["in place", "published"])
def test_a_journal_put_that_lands_after_the_commit_is_stale(remote, first):
    """A journal PUT held past the client's timeout is retried, and the held one reaches the
    store after the commit deleted the journal (as a slow server or network does): the
    checkpoint still reads whole, and the next save neither clears it nor mixes."""
    storage = remote.storage()  # the fixture's 3 s timeout
    target = remote.loc("ckpt")
    if first == "published":  # the journal of a publish over an existing checkpoint
        _save(storage, target, _version("old"), overwrite=False)
    journal = f"{remote.prefix}/.ckpt{PUBLISH_MARK}"
    remote.proxy.fault("delay", method="PUT", path=journal, times=1, seconds=6)
    files = _version("new")
    _save(storage, target, files)
    deadline = time.monotonic() + 60  # until the held PUT has reached the store
    while "delay" not in [r.fault for r in remote.proxy.requests] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert storage.head(remote.bucket, journal) is not None, "the late journal did not land"
    assert _read(storage, target)[0] == files
    newer = _version("newer")
    _save(storage, target, newer, overwrite=True)
    assert _read(storage, target)[0] == newer
    assert _left(remote) == sorted(f"ckpt/{n}" for n in [*newer, INDEX])


def test_a_save_appears_whole_at_commit(remote):
    storage = remote.storage()
    target = remote.loc("ckpt")
    files = _version("new")
    txn = storage.transaction(target, overwrite=False)
    txn.prepare()
    for name, data in files.items():
        write_small(storage, txn.folder / name, data)
    assert storage.list(target) == []
    txn.commit((INDEX, {"weight_map": {n: n for n in files}}))
    txn.discard()
    assert _read(storage, target)[0] == files
    assert _left(remote) == sorted(f"ckpt/{n}" for n in [*files, INDEX])  # no staging, no journal
    with pytest.raises(CheckpointError, match="overwrite=True"):
        _save(storage, target, _version("x"), overwrite=False)
    write_small(storage, f"{target}/notes.txt", b"mine")
    with pytest.raises(CheckpointError, match="notes.txt"):
        _save(storage, target, _version("x"))


def test_an_overwrite_replaces_the_files_and_drops_the_old_ones(remote):
    storage = remote.storage()
    target = remote.loc("ckpt")
    _save(storage, target, {**_version("old"), "extra.safetensors": b"old only"}, overwrite=False)
    new = _version("new")
    _save(storage, target, new)
    assert _read(storage, target)[0] == new


# Where a save stops: (the request the proxy fails, a substring of its path) or "staged".
STEPS = {
    "staged": "staged",
    "data file": ("PUT", "00002-of-00002"),
    "index": ("PUT", "index.json"),
    "journal": ("PUT", "publish.json"),
    "copy": ("PUT", "/ckpt/model-00001"),  # the server-side copy to the target (not the staging write)
    "old files": ("DELETE", "extra"),
}


@pytest.mark.parametrize("step", list(STEPS))
def test_a_save_stopped_at_any_step_leaves_a_whole_checkpoint(remote, step):
    storage = remote.storage()
    target = remote.loc("ckpt")
    old = {**_version("old"), "extra.safetensors": b"old only"}
    _save(storage, target, old, overwrite=False)
    new = _version("new")
    where = STEPS[step]
    if where != "staged":
        method, path = where
        if remote.scheme == "s3" and method == "DELETE":  # S3 deletes many keys in one POST ?delete
            method, path = "POST", "?delete"
        remote.proxy.fault("503", method=method, path=path, times=100)
    try:
        _save(storage, target, new, stop="staged" if where == "staged" else None)
    except (CheckpointError, KeyboardInterrupt):
        pass
    else:
        pytest.fail(f"not stopped: {[(r.method, r.path, r.status) for r in remote.proxy.requests]}")
    remote.proxy.clear()
    got, _ = _read(storage, target)
    published = step in ("copy", "old files")  # the journal was written: the new one is whole
    assert got == (new if published else old), step
    journal = remote.loc(f".ckpt{PUBLISH_MARK}")
    assert (storage.stat(journal) is not None) == published
    # the next save to the prefix finishes (or clears) what was left, then saves
    newer = _version("newer")
    _save(storage, target, newer)
    assert _read(storage, target)[0] == newer
    assert _left(remote) == sorted(f"ckpt/{n}" for n in [*newer, INDEX])


def test_a_reader_of_an_object_replaced_under_it_fails(remote):
    storage = remote.storage()
    loc = remote.loc("r/blob")
    write_small(storage, loc, b"a" * 5000)
    handle = storage.open(loc)
    write_small(storage, loc, b"b" * 5000)
    with pytest.raises(CheckpointError, match="replaced while being read"):
        handle.readinto(memoryview(bytearray(100)), 0)


def test_a_save_into_an_empty_prefix_writes_in_place_and_reads_as_empty_until_commit(remote):
    storage = remote.storage()
    target = remote.loc("ckpt")
    files = _version("new")
    txn = storage.transaction(target, overwrite=False)
    txn.prepare()
    for name, data in files.items():
        write_small(storage, txn.folder / name, data)
    # in place (no staging prefix, so no copy at commit), and yet no reader sees a checkpoint
    assert _left(remote) == sorted([*(f"ckpt/{n}" for n in files), f".ckpt{PUBLISH_MARK}"])
    assert storage.list(target) == []
    assert storage.stat(f"{target}/{next(iter(files))}") is None
    with pytest.raises(CheckpointError, match="no such object"):
        storage.open(f"{target}/{next(iter(files))}")
    # killed here (no commit, no discard): still nothing to load; the next save clears it first
    assert storage.list(target) == []
    newer = _version("newer")
    _save(storage, target, newer, overwrite=False)
    assert _read(storage, target)[0] == newer
    assert _left(remote) == sorted(f"ckpt/{n}" for n in [*newer, INDEX])


def test_a_failed_save_into_an_empty_prefix_leaves_it_empty(remote):
    storage = remote.storage()
    target = remote.loc("ckpt")
    with pytest.raises(KeyboardInterrupt):
        _save(storage, target, _version("new"), overwrite=False, stop="staged")
    assert _left(remote) == [] and storage.list(target) == []
