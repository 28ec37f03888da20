"""kill -9 of a process saving to an object store, at points spread over the whole save
(staging writes, the index, the journal, the copies, the deletes): the prefix then reads as the
previous checkpoint or the new one, whole, and the next save to it completes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proxy import Proxy
from test_publish import _left, _read, _save, _version

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "src"
SAVER = """
import json, os, sys
sys.path[:0] = [os.environ["SW_SRC"], os.environ["SW_TESTS"]]
from shardwise.io.storage.objects import ObjectStorage
from proxy import Proxy
from test_publish import _save
files = {f"model-{i:05d}-of-00012.safetensors": bytes([i]) * 20_000 for i in range(12)}
storage = ObjectStorage(os.environ["SW_SCHEME"], **json.loads(os.environ["SW_OPTIONS"]))
_save(storage, os.environ["SW_TARGET"], files)
print("saved", flush=True)
"""


@pytest.mark.parametrize("after", [4, 12, 20, 28, 36, 44])
def test_a_killed_save_leaves_a_whole_checkpoint(remote, after):
    storage = remote.storage()
    target = remote.loc("ckpt")
    old = _version("old")
    _save(storage, target, old, overwrite=False)
    new = {f"model-{i:05d}-of-00012.safetensors": bytes([i]) * 20_000 for i in range(12)}
    # the saver's own proxy, so that its connections alone are waited for after the kill
    proxy = Proxy(remote.server.endpoint, host=remote.proxy.host_mode, gcs_put=remote.proxy.gcs_put)
    options = {**remote.options, **({"endpoint": proxy.endpoint} if remote.scheme == "s3" else {})}
    env = {**os.environ, "SW_SRC": str(SRC), "SW_TESTS": str(HERE), "SW_SCHEME": remote.scheme,
           "SW_OPTIONS": json.dumps(options), "SW_TARGET": target, "STORAGE_EMULATOR_HOST": proxy.endpoint}
    saver = subprocess.Popen([sys.executable, "-c", SAVER], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while len(proxy.requests) < after and saver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    saver.send_signal(signal.SIGKILL)
    output = saver.communicate(timeout=60)[0].decode()
    assert saver.returncode in (-signal.SIGKILL, 0), output
    proxy.settle()  # what the dead process had sent lands (or not) before the next save
    proxy.close()
    got, _ = _read(storage, target)
    assert got in (old, new), (after, sorted(got))
    newer = _version("newer")
    _save(storage, target, newer)
    assert _read(storage, target)[0] == newer
    assert _left(remote) == sorted(f"ckpt/{n}" for n in [*newer, "model.safetensors.index.json"])
