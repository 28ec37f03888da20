"""The tests' own server launcher refuses to start SeaweedFS on a nearly full disk, with the free
space in the error: there SeaweedFS turns its volumes read-only and every PUT times out, which
once cost a CI run 30 minutes of timeouts that said nothing of the disk."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest
import servers


def test_a_nearly_full_disk_is_refused_before_seaweedfs_starts(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 << 30, 99 << 30, 1 << 30))
    with pytest.raises(RuntimeError, match=r"needs 2 GiB free .*: 1\.0 GiB free under .*free some disk"):
        servers.start_seaweedfs("/nonexistent/weed", tmp_path)
    assert not list(tmp_path.rglob("weed.log")), "the server must not have been started"
