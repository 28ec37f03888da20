"""Issue #44: what a user meets first on an object store, said in words naming the URL and the
fix: a bucket that does not exist (made on a save where the store makes buckets on a write,
refused with the command that makes it where it does not), no credentials, plain http without
``AWS_ALLOW_HTTP``, access denied, an endpoint that does not answer; and ``verify`` then says
UNREADABLE (exit status 4), not FAILED, since it read nothing."""

from __future__ import annotations

import uuid

import pytest
import torch
from servers import SECRET_KEY, free_port

import shardwise as sw
from shardwise.io.check.verify import UNREADABLE_STATUS, main_verify
from shardwise.io.storage.faults import NoSuchBucketError, StoreAccessError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def _unreadable(url: str, options: dict, capsys) -> str:
    report = sw.verify(url, storage_options=options)
    assert report.outcome == "UNREADABLE" and not report.ok, report.summary()
    assert main_verify(url, storage_options=options) == UNREADABLE_STATUS
    out = capsys.readouterr().out
    assert out.startswith(f"UNREADABLE {url}: "), out
    return report.unreadable


def test_a_save_makes_a_missing_bucket_where_the_store_makes_one_on_a_write(s3, tmp_path):
    """SeaweedFS makes a bucket on its first write: the save goes through, byte for byte the
    same save to a local folder."""
    url = f"s3://sw-new-{uuid.uuid4().hex[:8]}/ckpt"
    sw.save(_model(), url, storage_options=s3.options)
    sw.save(_model(), tmp_path / "local")
    assert sw.diff(url, tmp_path / "local", storage_options=s3.options).identical
    assert sw.verify(url, storage_options=s3.options).outcome == "OK"


def test_a_missing_bucket_the_store_does_not_make_is_refused_with_the_command(s3, capsys):
    """AWS S3 answers NoSuchBucket to the PUT too: the save names the one command that makes it."""
    s3.proxy.fault("nobucket", times=1000)
    url = f"s3://{s3.bucket}/{s3.prefix}/ckpt"
    with pytest.raises(NoSuchBucketError) as e:
        sw.save(_model(), url, storage_options=s3.options)
    message = str(e.value)
    assert f"the bucket '{s3.bucket}' does not exist" in message, message
    assert f"aws s3 mb s3://{s3.bucket}" in message and "<?xml" not in message, message
    assert "//" not in message.replace("s3://", ""), message
    assert "does not exist" in _unreadable(url, s3.options, capsys)


def _options(s3, **changes) -> dict:
    options = {**s3.options, "retries": 0}
    for key, value in changes.items():
        if value is None:
            options.pop(key, None)
        else:
            options[key] = value
    return options


CASES = {
    # no key in the options nor the environment: the client asks the instance metadata service
    # (here one that refuses, where a real machine has none or one that is not ours)
    "no credentials": (dict(access_key_id=None, secret_access_key=None,
                            metadata_endpoint=f"http://127.0.0.1:{free_port()}"),
                       ["no credentials found", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]),
    "plain http": (dict(allow_http=None), ["is plain http", "AWS_ALLOW_HTTP=true"]),
    "access denied": (dict(secret_access_key="not-the-secret"),
                      ["access denied", "AWS_SECRET_ACCESS_KEY"]),
    "unreachable": (dict(endpoint=f"http://127.0.0.1:{free_port()}"),
                    ["cannot reach http://127.0.0.1:", "connection refused", "AWS_ENDPOINT_URL"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_store_that_cannot_be_used_is_said_in_words(s3, case, monkeypatch, capsys):
    monkeypatch.delenv("AWS_ALLOW_HTTP", raising=False)
    changes, said = CASES[case]
    options = _options(s3, **changes)
    url = f"s3://{s3.bucket}/{s3.prefix}/ckpt"
    with pytest.raises(StoreAccessError) as e:
        sw.save(_model(), url, storage_options=options)
    message = str(e.value)
    assert url.rpartition("/")[0] in message or f"s3://{s3.bucket}/" in message, message
    assert all(s in message for s in said), message
    assert SECRET_KEY not in message and "not-the-secret" not in message and "Debug source" not in message
    reason = _unreadable(url, options, capsys)
    assert all(s in reason for s in said), reason


def test_the_words_keep_a_fault_they_do_not_know_whole():
    """A fault that is none of the above keeps its first line, and the server's code and message
    that the line cut off (the XML body)."""
    from shardwise.io.storage.faults import in_words

    text = ('Generic S3 error: ... 409 Conflict: <?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>'
            "BucketNotEmpty</Code><Message>The bucket you tried to delete is not empty</Message></Error>")
    said = in_words(RuntimeError(text), "DELETE s3://b/", lambda e: str(e).splitlines()[0])
    assert type(said) is sw.CheckpointError
    assert str(said).endswith("BucketNotEmpty: The bucket you tried to delete is not empty"), said
