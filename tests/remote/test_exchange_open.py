"""A load from an object store reads each byte once and exchanges slabs (``io.exchange``), so its
read is a collective, as a DCP checkpoint's read always is. A rank that fails before it (opening
the checkpoint, matching its keys) must not leave its peers waiting in the read's first
collective: every rank raises, the failing one its own error, its peers an error carrying that
rank's message (not the collective's timeout or a closed connection)."""

from __future__ import annotations

import os

import pytest
import torch
from proxy import Proxy
from test_faults_verbs import _outcome

import shardwise as sw
from models import make_model, tiny_plan
from shardwise.testing import spawn

TIMEOUT = 60.0  # the ranks' collective timeout: what a peer left waiting would run into


def loading(url: str, options: dict, fault: str, bad: str) -> tuple:
    """Load at tp=2; rank 1 fails before the read: its store answers 503 to everything
    (``open``), or its model has a buffer the checkpoint lacks (``match``)."""
    backend = sw.init_backend("gloo", timeout=TIMEOUT)
    with torch.device("meta"):
        model = make_model()
    if backend.rank == 1 and fault == "open":
        options = {**options, "endpoint": bad} if "endpoint" in options else options
        os.environ["STORAGE_EMULATOR_HOST"] = bad  # gs:// (obstore reads it when the store is made)
    if backend.rank == 1 and fault == "match":
        model.register_buffer("extra_scale", torch.ones(2))
    return _outcome(lambda: sw.load(model, url, plan=tiny_plan(), mesh=backend.mesh(tp=2),
                                    storage_options=options).tensors)


@pytest.mark.parametrize(("distributed", "fault"), [(False, "open"), (False, "match"), (True, "open")])
def test_a_rank_failing_before_the_read_fails_every_rank(remote, distributed, fault):
    url = remote.url("src").rstrip("/")
    sw.save(make_model(), url, distributed=distributed, storage_options=remote.options)
    bad = Proxy(remote.server.endpoint, host=remote.proxy.host_mode, gcs_put=remote.proxy.gcs_put)
    bad.fault("503", times=1_000_000)
    env = {k: os.environ[k] for k in ("STORAGE_EMULATOR_HOST",) if k in os.environ}
    try:
        results = spawn(loading, 2, args=(url, remote.options, fault, bad.endpoint), env=env, timeout=300)
    finally:
        bad.close()
    assert [r[0] for r in results] == ["error", "error"], results
    own = "extra_scale" if fault == "match" else "503"
    assert own in results[1][2], results[1]
    # rank 0 learns of rank 1's failure from rank 1, not from the collective's timeout
    assert "rank 1" in results[0][2] and own in results[0][2], results[0]
    assert bad.count("GET") + bad.count("HEAD") > 0 or fault == "match"
