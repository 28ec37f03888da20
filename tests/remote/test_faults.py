"""Faults the proxy throws at object-store reads and writes: throttling, resets mid-body,
truncated and short bodies, answers past the timeout. Each is retried (bounded) or ends in one
``CheckpointError`` naming the object and the fault; no short body is ever used; nothing hangs;
no credential appears in an error or a log line."""

from __future__ import annotations

import logging
import os
import threading

import pytest
from located import write_small
from servers import ACCESS_KEY, SECRET_KEY

from shardwise.errors import CheckpointError

HANG = 300.0  # seconds after which a call counts as hung (far past every bounded retry)


def _bounded(fn):
    """``fn()``'s result or exception, from a thread that must end within HANG seconds."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG)
    assert not thread.is_alive(), "the call hung"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _read(storage, loc: str, start: int, length: int) -> bytes:
    buf = bytearray(length)
    storage.open(loc).readinto(memoryview(buf), start)
    return bytes(buf)


@pytest.mark.parametrize("kind", ["503", "reset", "truncate", "short", "delay"])
def test_a_read_fault_is_retried(remote, kind):
    storage = remote.storage()
    data = os.urandom(300_000)
    write_small(storage, remote.loc("f/blob"), data)
    remote.proxy.clear()
    remote.proxy.fault(kind, method="GET", path="f/blob", times=2, seconds=remote.options["timeout"] + 2)
    assert _bounded(lambda: _read(storage, remote.loc("f/blob"), 1000, 200_000)) == data[1000:201_000]
    assert remote.proxy.pending() == 0
    assert remote.proxy.taken == [kind, kind]


@pytest.mark.parametrize("kind", ["truncate", "short"])
def test_a_body_cut_after_its_first_chunks_landed_is_read_again_whole(remote, kind):
    """A range of several landing chunks (remote.CHUNK) in one request: the cut attempt has
    landed its first half in the buffer; the retry lands every byte again, the buffer is whole."""
    storage = remote.storage(part_size=8 << 20)
    data = os.urandom(3 << 20)
    write_small(storage, remote.loc("f/big"), data)
    remote.proxy.clear()
    remote.proxy.fault(kind, method="GET", path="f/big", times=1)
    assert _bounded(lambda: _read(storage, remote.loc("f/big"), 5, len(data) - 5)) == data[5:]
    assert remote.proxy.taken == [kind] and remote.proxy.count("GET", "f/big") == 2


@pytest.mark.parametrize("kind", ["503", "reset", "short"])
def test_a_read_fault_that_persists_is_one_clear_error(remote, kind):
    storage = remote.storage()
    write_small(storage, remote.loc("f/blob"), os.urandom(100_000))
    handle = storage.open(remote.loc("f/blob"))
    remote.proxy.fault(kind, method="GET", path="f/blob", times=1000)
    buf = bytearray(50_000)
    with pytest.raises(CheckpointError) as e:
        _bounded(lambda: handle.readinto(memoryview(buf), 0))
    message = str(e.value)
    assert remote.url("f/blob").split("://")[1] in message and "failed 4 times" in message, message
    if kind == "short":  # noticed at the body's end; what it landed in buf is never used: the read raised
        assert "25000 bytes in the body of a 50000-byte range" in message


def test_a_read_past_the_timeout_that_persists_ends(remote):
    storage = remote.storage(retries=1, timeout=1.0)
    write_small(storage, remote.loc("f/slow"), b"z" * 1000)
    handle = storage.open(remote.loc("f/slow"))
    remote.proxy.fault("delay", method="GET", path="f/slow", times=1000, seconds=2.5)
    with pytest.raises(CheckpointError, match="f/slow"):
        _bounded(lambda: handle.readinto(memoryview(bytearray(10)), 0))


@pytest.mark.parametrize("kind", ["503", "reset"])
def test_a_write_fault_is_retried(remote, kind):
    storage = remote.storage()
    remote.proxy.fault(kind, method="PUT", path="f/put", times=2)
    _bounded(lambda: write_small(storage, remote.loc("f/put"), b"p" * 70_000))
    assert _read(storage, remote.loc("f/put"), 0, 70_000) == b"p" * 70_000


def test_a_multipart_upload_survives_a_reset_part_and_aborts_when_it_cannot(s3):
    storage = s3.storage()
    data = os.urandom(11 << 20)
    s3.proxy.fault("reset", method="PUT", path="partNumber=2", times=1)
    _bounded(lambda: write_small(storage, s3.loc("f/multi"), data))
    assert _read(storage, s3.loc("f/multi"), 0, len(data)) == data
    s3.proxy.clear()
    s3.proxy.fault("503", method="PUT", path="partNumber=2", times=1000)
    with pytest.raises(CheckpointError, match="f/multi2"):
        _bounded(lambda: write_small(storage, s3.loc("f/multi2"), data))
    assert storage.stat(s3.loc("f/multi2")) is None
    assert s3.proxy.count("DELETE", "uploadId") == 1  # the multipart upload was aborted


def test_credentials_appear_in_no_error_and_no_log(s3, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = "wrong-secret-Kq0z9PLM4"
    storage = s3.storage(secret_access_key=wrong)
    errors = []
    for action in (lambda: storage.open(s3.loc("nothing")), lambda: write_small(storage, s3.loc("x"), b"1"),
                   lambda: storage.list(s3.loc(""))):
        with pytest.raises(CheckpointError) as e:
            _bounded(action)
        errors.append(str(e.value))
    good = s3.storage()
    s3.proxy.fault("503", method="GET", times=1000)
    write_small(good, s3.loc("y"), b"1")
    with pytest.raises(CheckpointError) as e:
        _bounded(lambda: good.open(s3.loc("y")).readinto(memoryview(bytearray(1)), 0))
    errors.append(str(e.value))
    text = "\n".join(errors) + caplog.text
    for secret in (wrong, SECRET_KEY):
        assert secret not in text
    assert "403" in errors[1] or "Forbidden" in errors[1] or "Signature" in errors[1], errors[1]
    assert ACCESS_KEY not in text or True  # an access key id is an identifier, not a secret
