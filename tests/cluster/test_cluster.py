"""What only shows across nodes, on a simulated cluster (conftest.py: 2 nodes x 2 ranks, 200
Mbit/s per node, SeaweedFS on a storage host): replicas read once, counted by the storage host's
NIC; a distributed save to a folder the nodes do not share; a transfer between nodes; faults on
node 1: its link taken down, every process on it SIGKILLed, or its rate at a tenth (it completes,
exact), during load, gather save, distributed save and transfer; and, on a second cluster with
a back-end fabric, the exchange's bytes on the fabric and only the store's on each NIC. The
ranks' side is node.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

FAULT_TIMEOUT = 8.0  # seconds: the collectives' and the storage client's timeout in the fault runs


@pytest.fixture
def checkpoint(job):
    """The toy's checkpoint in the bucket: its URL and its bytes."""
    url = job.url("ckpt")
    return url, job.once(0, "upload", url)["bytes"]


def _nodes(records: list[dict]) -> dict[str, list[int]]:
    hosts: dict[str, list[int]] = {}
    for r in records:
        hosts.setdefault(r["host"], []).append(r["rank"])
    return hosts


def test_replicas_read_once_across_nodes(cluster, job, checkpoint):
    url, size = checkpoint
    before = cluster.counters("storage")["tx_bytes"]
    records = job.ranks("replicas", url)
    sent = cluster.counters("storage")["tx_bytes"] - before
    assert sorted(_nodes(records).values()) == [[0, 1], [2, 3]], "tp=2 inside a node, dp=2 over the nodes"
    assert [r["bad"] for r in records] == [[]] * 4
    # every byte the store's NIC sent (headers, listings, HTTP included), counted by the kernel
    print(f"the store sent {sent / size:.4f}x the checkpoint ({size} bytes)")
    assert sent <= 1.05 * size, f"the store sent {sent / size:.3f}x the checkpoint"
    assert sum(r["bytes_read"] for r in records) <= 1.01 * size


def test_distributed_save_to_a_folder_the_nodes_do_not_share(cluster, job):
    local = f"/tmp/dcp-{job.tag}"
    records = job.ranks("saves", job.url("dcp"), local)
    assert [r["bad"] for r in records] == [[]] * 4, "the s3:// save reloads byte for byte at tp=4"
    outcomes = {r["local"] for r in records}
    assert len(outcomes) == 1 and "saved" not in outcomes, f"a save to private folders passed: {outcomes}"
    (message,) = outcomes
    assert "CheckpointError" in message and "share" in message, message
    for node in range(cluster.nodes):  # nothing left behind on either node's own /tmp
        left = [p.name for p in cluster.node_tmp(node).iterdir() if job.tag in p.name]
        assert left == [], f"node{node} kept {left}"


def test_transfer_between_nodes_is_exact(cluster, job):
    before = [cluster.counters(n)["rx_bytes"] for n in range(cluster.nodes)]
    records = job.ranks("transfer")
    received = [cluster.counters(n)["rx_bytes"] - b for n, b in enumerate(before)]
    assert sorted(_nodes(records).values()) == [[0, 1], [2, 3]]
    assert [r["bad"] for r in records] == [[]] * 4
    engine = int(next(r["host"] for r in records if r["rank"] == 2)[len("node"):])
    size = 13_000_000  # about the toy's bytes: every byte of the engine's shards crossed its NIC
    assert received[engine] > size * 0.9, received


SLOW_MBIT = 20  # the slow node's rate in both directions, against the cluster's 200


def _fault_run(cluster, job, what: str, how: str, url: str, target: str) -> tuple[list[dict], float]:
    """node.py's fault mode on both nodes; node 1 is hit a second into it: its link taken down
    (``link``, put back once node 0's ranks have raised), every process on it SIGKILLed (``kill``),
    both at 20 Mbit/s per node; or (``slow``) it runs at SLOW_MBIT against the others' 200, for
    two rounds with a timeout that a correct run fits in."""
    runs: list = []
    out = job.out
    slow = how == "slow"
    timeout = 4 * FAULT_TIMEOUT if slow else FAULT_TIMEOUT
    script = job.script("fault", what, url, target, str(timeout), "2" if slow else "30")
    thread = threading.Thread(target=lambda: runs.extend(cluster.torchrun(
        script, timeout=12 * timeout, env=cluster.s3_env)))
    for node in range(cluster.nodes):
        rate = cluster.mbit if slow and node == 0 else 20 if not slow else SLOW_MBIT
        cluster.rate(node, rate, rate)
    hit = None
    try:
        thread.start()
        deadline = time.monotonic() + 60
        while len(list(out.glob("started*"))) < cluster.world_size and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list(out.glob("started*"))) == cluster.world_size, "the fault run did not start"
        time.sleep(1.0)
        if how == "link":
            cluster.link(1, False)
        elif how == "kill":
            assert cluster.kill(1), "no process on node 1 to kill"
        hit = time.time()
        deadline = time.monotonic() + 4 * timeout
        while len(list(out.glob("rank*.json"))) < cluster.ranks_per_node and time.monotonic() < deadline:
            time.sleep(0.1)
        if how == "kill":  # node 0's torchrun would wait out its exit barrier for the dead node's
            cluster.kill(0)
    finally:
        cluster.link(1, True)  # the partitioned node's ranks then meet closed peers and end
        thread.join(timeout=15 * timeout)
        for node in range(cluster.nodes):
            cluster.rate(node, cluster.mbit, cluster.mbit)
    assert hit is not None
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    for r in records:
        late = r["raised"] - hit if r["raised"] else None
        print(f"{what}/{how}: rank {r['rank']} on {r['host']}: {r['done']} rounds, raised {late}s after; "
              f"{r['outcome'][:300]}")
    return records, hit


def _survivors_raise(cluster, records: list[dict], hit: float) -> list[dict]:
    """Node 0's ranks (every one of them) each raised within 2x the timeout of the fault."""
    survivors = [r for r in records if r["host"] != "node1"]
    assert len(survivors) == cluster.ranks_per_node, records
    for r in survivors:
        assert r["raised"] is not None, f"rank {r['rank']} on {r['host']} did not raise: {r['outcome']}"
        late = r["raised"] - hit
        assert late <= 2 * FAULT_TIMEOUT, f"rank {r['rank']} raised {late:.1f} s after the fault"
    return survivors


def _previous_intact(job, target: str, records: list[dict]) -> int:
    """``target`` (seed 0 before the run, each round's save seed 0 + round) holds one whole
    round's checkpoint, byte for byte: the last that every rank finished, or the one the fault hit
    if its commit had landed; never a mix, and no staging prefix is left beside it."""
    done = min(r["done"] for r in records)
    found = job.once(0, "verify", target, str(done), timeout=180)
    print(f"after {done} rounds {target} holds round {found['held']}; objects: {found['objects']}")
    assert found["held"] in (done, done + 1), f"{target}: not a whole round's checkpoint: {found}"
    staged = [o for o in found["objects"] if ".shardwise-" in o and "published" not in o]
    assert staged == [], f"a failed save left {staged}"
    return found["held"]


@pytest.mark.parametrize("what", ["load", "save"])
def test_a_link_down_mid_operation(cluster, job, checkpoint, what):
    url, _ = checkpoint
    records, down = _fault_run(cluster, job, what, "link", url, job.url("faulty") + "/")
    survivors = _survivors_raise(cluster, records, down)
    if what == "save":
        failed = {r["failed"] for r in survivors}
        assert len(failed) == 1 and None not in failed, failed
        failed_url = failed.pop()
        found = job.once(0, "absent", failed_url)
        print(found["outcome"][:300], found["objects"])
        assert not found["outcome"].startswith("loaded"), "a failed save left a checkpoint that loads"
        assert "CheckpointError" in found["outcome"], found["outcome"]
        # the failed save into a new prefix left nothing: rank 0 discarded what it found, and each
        # rank of the partitioned node swept its own last objects once it raised (Publish.sweep)
        key = failed_url.removeprefix("s3://").partition("/")[2]
        parent, _, name = key.rpartition("/")
        left = [o for o in found["objects"] if o.startswith((f"{key}/", f"{parent}/.{name}."))]
        assert left == [], f"the failed save left {left}"


@pytest.mark.parametrize("what", ["load", "gather", "save", "transfer"])
def test_a_node_killed_mid_operation(cluster, job, checkpoint, what):
    """Every process of node 1 SIGKILLed: node 0's ranks raise; a save's target keeps a whole
    checkpoint (the previous one, or the round whose commit had landed)."""
    url, _ = checkpoint
    target = url  # seed 0: each round overwrites it (the load, before, reads it)
    records, killed = _fault_run(cluster, job, what, "kill", url, target)
    assert {r["host"] for r in records} == {"node0"}, "a killed node wrote no record"
    _survivors_raise(cluster, records, killed)
    if what in ("gather", "save"):
        _previous_intact(job, target, records)


@pytest.mark.parametrize("what", ["load", "gather", "save", "transfer"])
def test_a_slow_node_completes_exactly(cluster, job, checkpoint, what):
    """Node 1 at a tenth of node 0's rate, within the timeout: the job waits for it and ends
    right (a slow node is no failure); raising is for a node slower than the timeout."""
    url, _ = checkpoint
    target = url  # seed 0: each round overwrites it (the load, before, reads it)
    records, _ = _fault_run(cluster, job, what, "slow", url, target)
    assert len(records) == cluster.world_size, records
    for r in records:
        assert (r["outcome"], r["done"], r["bad"]) == ("no error", 2, []), r
    if what in ("gather", "save"):
        assert _previous_intact(job, target, records) == 2, "the last round's save is in place"


def _namespaces() -> list[str]:
    import subprocess

    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def test_a_cluster_removes_what_it_made_and_what_a_crashed_run_left():
    from shardwise.testing.cluster import PREFIX, Cluster, remove_leftovers, unavailable

    reason = unavailable()
    if reason:
        pytest.skip(f"no simulated cluster here: {reason}")
    import subprocess

    crashed = f"{PREFIX}4194305-n0"  # above the largest pid Linux gives: that run is gone
    subprocess.run(["ip", "netns", "add", crashed], check=True)
    folder = Path("/var/tmp") / f"{PREFIX}4194305-ab12-x"
    (folder / "node0").mkdir(parents=True, exist_ok=True)
    try:
        with Cluster(nodes=1, mbit=None) as c:
            made = [ns for ns in _namespaces() if ns.startswith(c.tag)]
            assert len(made) == 3 and crashed not in _namespaces()  # switch, storage, node 0
            assert c.run(0, ["hostname"], timeout=30).strip() == "node0"
            root = c.root
        assert not [ns for ns in _namespaces() if ns.startswith(c.tag)] and not root.exists()
    finally:
        remove_leftovers()
    assert crashed not in _namespaces() and not folder.exists()


def test_a_fabric_carries_the_exchange_and_the_nic_the_store_bytes(fabric_cluster, fabric_job):
    """tp over 2 nodes with a back-end fabric: each node's front-end NIC receives its share from
    the store and no more; the rowwise pieces its peer fetched for it come over the fabric."""
    from shardwise.testing.cluster import FABRIC_DEV

    c, job = fabric_cluster, fabric_job
    url = job.url("ckpt")
    job.once(0, "upload", url)
    front = [c.counters(n)["rx_bytes"] for n in range(c.nodes)]
    fabric = [c.counters(n, FABRIC_DEV)["rx_bytes"] for n in range(c.nodes)]
    records = job.ranks("tp_load", url)
    front = [c.counters(n)["rx_bytes"] - b for n, b in enumerate(front)]
    fabric = [c.counters(n, FABRIC_DEV)["rx_bytes"] - b for n, b in enumerate(fabric)]
    assert sorted(_nodes(records).values()) == [[0], [1]], "one rank per node: tp over the nodes"
    assert [r["bad"] for r in records] == [[]] * 2
    for r in records:
        node = int(r["host"][len("node"):])
        print(f"{r['host']}: share {r['share']}, read {r['bytes_read']}, front-end rx "
              f"{front[node] / r['share']:.3f}x the share, fabric rx {fabric[node] / r['share']:.3f}x")
        assert front[node] <= 1.05 * r["share"], f"{r['host']}'s NIC received {front[node] / r['share']:.3f}x"
        # every byte this node holds came from the store or over the fabric
        assert front[node] + fabric[node] >= r["share"], (front, fabric, r)
        assert fabric[node] > 0.02 * r["share"], f"{r['host']}: no exchange on the fabric ({fabric[node]} B)"
