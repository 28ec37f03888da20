"""A cluster on one machine: N simulated nodes, each with its own network stack and NIC rate, its
own host name and its own ``/tmp``, plus a storage host, joined by a switch; for the tests and
benchmarks of what only shows across nodes (replicas reading once, a save to a folder the nodes
do not share, a partition mid-load). Linux only, as root, with iproute2 and util-linux.

The wiring, every piece inside network namespaces this module makes (``{prefix}{pid}-...``), so
that no packet can leave them: a switch namespace holds a bridge; each node and the storage host
is a namespace with one veth (``eth0``) into it, addressed on ``10.47.0.0/24``. A node's upload
rate is a ``tbf`` on its ``eth0``, its download rate a ``tbf`` on its switch port (both egress: no
ifb needed); the queue holds ``QUEUE_SECONDS`` of the rate (shallower queues drop packets and make
even a raw download erratic). Ranks on one node talk over the node's own address (the kernel
routes it through loopback: the fast interconnect inside a node). With ``fabric_mbit``, a second
bridge in the switch namespace is the back-end fabric of a GPU cluster (InfiniBand, EFA): each
node gets a second veth (``fab0``, on ``10.48.0.0/24``, at that rate each way; the storage host
is not on it) and torchrun's rendezvous and gloo (``GLOO_SOCKET_IFNAME``) use it, so that the
collectives' bytes leave ``eth0`` to the store's. A process runs "on" a host
through ``ip netns exec`` and ``unshare --mount --uts``: its host name is ``node{i}``, ``/tmp`` is
the node's private folder (``Cluster.node_tmp``) and ``/etc/hosts`` names every host; every node
sees ``Cluster.shared`` (and the repository and venv) at one path. ``close`` (and leaving the
``with``) kills what ran in the namespaces and deletes them; a new cluster first removes what a
crashed run of this machine left (its pid is gone).

>>> from shardwise.testing.cluster import Cluster
>>> with Cluster(nodes=2, ranks_per_node=2, mbit=200) as c:     # doctest: +SKIP
...     runs = c.torchrun(["script.py"], timeout=60)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from shardwise.errors import UsageError
from shardwise.testing import netns
from shardwise.testing.netns import MTU, PREFIX, ClusterError, remove_leftovers, unavailable

SUBNET = "10.47.0"
STORAGE_IP = f"{SUBNET}.2"
FABRIC_SUBNET = "10.48.0"  # the back-end fabric's addresses (nodes only: no storage host on it)
FABRIC_DEV = "fab0"
RDZV_PORT = 29400


@dataclass(frozen=True)
class NodeRun:
    """One node's torchrun: its exit status and log (stdout and stderr)."""

    node: int
    returncode: int | None
    log: str
    seconds: float


class Cluster:
    """``nodes`` simulated nodes of ``ranks_per_node`` ranks at ``mbit`` down and up each (None:
    unlimited), and a storage host at ``storage_mbit`` (None: unlimited). ``fabric_mbit``: the
    nodes' back-end fabric for the collectives at that rate each way (None: none, the collectives
    share ``eth0`` with the storage traffic). ``root``: where the node folders and the shared
    folder go (not under /tmp, which each node replaces)."""

    def __init__(self, nodes: int = 2, ranks_per_node: int = 1, *, mbit: float | None = 200.0,
                 storage_mbit: float | None = None, root: str | os.PathLike | None = None,
                 prefix: str = PREFIX, fabric_mbit: float | None = None):
        if not 1 <= nodes <= 200 or ranks_per_node < 1:
            raise UsageError(f"nodes={nodes}, ranks_per_node={ranks_per_node}: 1-200 nodes, 1 rank or more")
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.mbit, self.storage_mbit, self.prefix = mbit, storage_mbit, prefix
        self.fabric_mbit = fabric_mbit
        self._given_root = root
        self.tag = f"{prefix}{os.getpid()}-{os.urandom(2).hex()}"
        self._procs: list[subprocess.Popen] = []
        self._namespaces: list[str] = []
        self.root = Path()

    def ns(self, where: int | str) -> str:
        """The namespace of node ``where`` (an int), ``"storage"`` or ``"switch"``."""
        return f"{self.tag}-{'n' + str(where) if isinstance(where, int) else where[:2]}"

    def ip(self, where: int | str) -> str:
        return STORAGE_IP if where == "storage" else f"{SUBNET}.{10 + int(where)}"

    def fabric_ip(self, node: int) -> str:
        """Node ``node``'s address on the fabric (the front-end one without a fabric)."""
        return self.ip(node) if self.fabric_mbit is None else f"{FABRIC_SUBNET}.{10 + node}"

    @staticmethod
    def hostname(where: int | str) -> str:
        return "storage" if where == "storage" else f"node{where}"

    def node_tmp(self, node: int) -> Path:
        """Node ``node``'s ``/tmp``, as this (outside) process sees it."""
        return self.root / f"node{node}" / "tmp"

    @property
    def shared(self) -> Path:
        """A folder every node sees at this same path (a shared filesystem)."""
        return self.root / "shared"

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        reason = unavailable()
        if reason:
            raise ClusterError(f"cannot make a simulated cluster: {reason}")
        remove_leftovers(self.prefix)
        root = Path(self._given_root) if self._given_root else Path(tempfile.mkdtemp(
            prefix=f"{self.tag}-", dir="/var/tmp" if Path("/var/tmp").is_dir() else None))
        if Path("/tmp") in [root.resolve(), *root.resolve().parents]:
            raise UsageError(f"root={root}: not under /tmp, which every node replaces with its own")
        self.root = root
        try:
            self._wire()
        except BaseException:
            self.close()
            raise

    def _wire(self) -> None:
        hosts = ["127.0.0.1 localhost", f"{STORAGE_IP} storage"] + [
            f"{self.ip(i)} {self.hostname(i)}" for i in range(self.nodes)]
        (self.root / "hosts").write_text("\n".join(hosts) + "\n")
        self.shared.mkdir(parents=True, exist_ok=True)
        switch = self.ns("switch")
        self._add_namespace(switch)
        bridges = ["br0"] if self.fabric_mbit is None else ["br0", "br1"]
        for bridge in bridges:
            netns.ip("-n", switch, "link", "add", bridge, "type", "bridge")
            netns.ip("-n", switch, "link", "set", bridge, "mtu", str(MTU), "up")
        for where in ["storage", *range(self.nodes)]:
            ns, port = self.ns(where), "st" if where == "storage" else f"n{where}"
            self._add_namespace(ns)
            if where != "storage":
                for sub in ("tmp", "home"):
                    (self.root / f"node{where}" / sub).mkdir(parents=True, exist_ok=True)
            # no IPv6 chatter (router solicitations) in the byte counters
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                            "net.ipv6.conf.default.disable_ipv6=1"], capture_output=True)
            netns.ip("-n", ns, "link", "set", "lo", "up")
            netns.plug(switch, "br0", port, ns, "eth0", f"{self.ip(where)}/24")
            mbit = self.storage_mbit if where == "storage" else self.mbit
            self.rate(where, mbit, mbit)
            if where != "storage" and self.fabric_mbit is not None:
                netns.plug(switch, "br1", f"f{where}", ns, FABRIC_DEV, f"{self.fabric_ip(where)}/24")
                netns.tbf(switch, f"f{where}", self.fabric_mbit)
                netns.tbf(ns, FABRIC_DEV, self.fabric_mbit)

    def _add_namespace(self, ns: str) -> None:
        netns.ip("netns", "add", ns)
        self._namespaces.append(ns)

    def close(self) -> None:
        """Stop every process this cluster started, delete its namespaces and folders."""
        for p in self._procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._procs.clear()
        for ns in reversed(self._namespaces):
            netns.remove_namespace(ns)
        self._namespaces.clear()
        if self.root != Path() and not self._given_root:
            shutil.rmtree(self.root, ignore_errors=True)

    # --- the links -----------------------------------------------------------------------------

    def rate(self, where: int | str, down_mbit: float | None, up_mbit: float | None) -> None:
        """Set a host's download and upload rates (None: unlimited), e.g. a slow node."""
        port = "st" if where == "storage" else f"n{where}"
        netns.tbf(self.ns("switch"), port, down_mbit)   # the switch sends to the host: its download
        netns.tbf(self.ns(where), "eth0", up_mbit)

    def link(self, where: int | str, up: bool) -> None:
        """Take a host's cables out (``up=False``: a partition, from the fabric too) or put them back."""
        fabric = where != "storage" and self.fabric_mbit is not None
        ports = ["st"] if where == "storage" else [f"n{where}"] + [f"f{where}"] * fabric
        for port in ports:
            netns.ip("-n", self.ns("switch"), "link", "set", port, "up" if up else "down")

    def kill(self, where: int | str) -> list[int]:
        """SIGKILL every process on a host (its ranks, their torchrun): a node crash; the ids."""
        return netns.kill_in(self.ns(where))

    def counters(self, where: int | str, dev: str = "eth0") -> dict[str, int]:
        """The bytes and packets a host's NIC (``dev``: ``FABRIC_DEV`` for its fabric port) has
        received and sent (``rx_bytes``, ``tx_bytes``, ...), as the kernel counts them: outside
        every process of the host."""
        return netns.counters(self.ns(where), dev)

    # --- running on a host --------------------------------------------------------------------

    def command(self, where: int | str, argv: list[str]) -> list[str]:
        """``argv`` as a command that runs on host ``where`` (its network, name, ``/tmp``)."""
        tmp = self.root / "storage-tmp" if where == "storage" else self.node_tmp(int(where))
        tmp.mkdir(parents=True, exist_ok=True)
        # the checkout and interpreter a job runs from stay visible where they lie under /tmp
        runs_from = (Path(p).resolve() for p in (sys.prefix, os.getcwd(), *sys.path) if p)
        kept = sorted({q.parts[2] for q in runs_from if q.parts[1:2] == ("tmp",) and len(q.parts) > 2})
        for name in kept:
            (tmp / name).mkdir(exist_ok=True)
        setup = ("".join(f'mount --bind "/tmp/{n}" "$2/{n}" && ' for n in kept) + 'hostname "$1" && '
                 'mount --rbind "$2" /tmp && mount --bind "$3" /etc/hosts && shift 3 && exec "$@"')
        return ["ip", "netns", "exec", self.ns(where), "unshare", "--mount", "--uts", "--propagation",
                "private", "--", "/bin/sh", "-c", setup, "sh", self.hostname(where), str(tmp),
                str(self.root / "hosts"), *argv]

    def popen(self, where: int | str, argv: list[str], *, env: dict | None = None, log: Path | None = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` on host ``where`` in its own process group; ``close`` kills it."""
        env = {**os.environ, "TMPDIR": "/tmp", **(env or {})}
        with open(log if log is not None else os.devnull, "wb") as out:  # the child keeps its own
            p = subprocess.Popen(self.command(where, argv), env=env, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True, **kwargs)
        self._procs.append(p)
        return p

    def run(self, where: int | str, argv: list[str], *, timeout: float, env: dict | None = None) -> str:
        """``argv``'s output, run on host ``where``; ``ClusterError`` if it fails or outlasts ``timeout``."""
        log = self.root / f"run-{time.monotonic_ns()}.log"
        p = self.popen(where, argv, env=env, log=log)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        text = log.read_text(errors="replace")
        log.unlink()
        if p.returncode:
            raise ClusterError(f"{argv[:3]} on {self.hostname(where)} ended with {p.returncode}:\n"
                               f"{text[-3000:]}")
        return text

    def torchrun(self, script: list[str], *, timeout: float, env: dict | None = None,
                 nodes: list[int] | None = None, ranks_per_node: int | None = None,
                 fabric: bool | None = None) -> list[NodeRun]:
        """``script`` (a path and its arguments) under torchrun on every node (or ``nodes``),
        ``ranks_per_node`` ranks each (default: the cluster's), joined by c10d rendezvous on node
        0's address, over the fabric (``fabric``: default, whether the cluster has one; False:
        over ``eth0`` beside the storage traffic, as without one). Each node's run ends by itself
        or is killed at ``timeout``; never raises for a failed node (a fault test expects some)."""
        chosen = list(range(self.nodes)) if nodes is None else nodes
        fabric = self.fabric_mbit is not None if fabric is None else fabric
        if fabric and self.fabric_mbit is None:
            raise UsageError("torchrun(fabric=True) on a cluster made without fabric_mbit")
        nic = FABRIC_DEV if fabric else "eth0"  # the collectives' NIC
        addr = self.fabric_ip if fabric else self.ip
        env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": nic, "PYTHONUNBUFFERED": "1", **(env or {})}
        procs, logs, t0 = [], [], time.monotonic()
        for node in chosen:
            log = self.root / f"node{node}-torchrun-{time.monotonic_ns()}.log"
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(chosen)),
                    "--nproc-per-node", str(ranks_per_node or self.ranks_per_node), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"{addr(chosen[0])}:{RDZV_PORT}", "--rdzv-id", self.tag,
                    "--local-addr", addr(node), "--max-restarts", "0",
                    # torch finds the store's host by its name, which is on the front-end address
                    "--rdzv-conf", f"is_host={int(node == chosen[0])}", *script]
            procs.append(self.popen(node, argv, env={**env, "SHARDWISE_NODE": str(node)}, log=log))
            logs.append(log)
        out, deadline = [], t0 + timeout
        for node, p, log in zip(chosen, procs, logs, strict=True):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            out.append(NodeRun(node, p.returncode, log.read_text(errors="replace"), time.monotonic() - t0))
        return out


S3_PORT = 8333
S3_KEYS = {"AWS_ACCESS_KEY_ID": "shardwise-cluster-access",
           "AWS_SECRET_ACCESS_KEY": "shardwise-cluster-secret-7Qm"}
_READY = """
import sys, time, urllib.error, urllib.request
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        urllib.request.urlopen(sys.argv[1], timeout=2)
        sys.exit(0)
    except urllib.error.HTTPError as e:
        sys.exit(0 if e.code in (400, 403) else 1)
    except OSError:
        time.sleep(0.25)
sys.exit(f"no answer from {sys.argv[1]}")
"""
# SeaweedFS makes a bucket on its first write (obstore has no call that makes one)
_BUCKETS = """
import sys, obstore
from obstore.store import S3Store
for name in sys.argv[1:]:
    store = S3Store(name, client_options={"allow_http": True})
    obstore.put(store, "_bucket", b"")
    obstore.delete(store, "_bucket")
"""


def start_seaweedfs(cluster: Cluster, weed: str, *, buckets: tuple[str, ...] = (),
                    timeout: float = 60.0) -> dict[str, str]:
    """SeaweedFS's S3 gateway (``weed server -s3``, the server of the remote tests) on the storage
    host, one identity with every action, ``buckets`` made (with obstore); the ``AWS_*``
    variables that reach it from a node."""
    folder = cluster.root / "seaweedfs"
    (folder / "data").mkdir(parents=True)
    (folder / "s3.json").write_text(json.dumps({"identities": [{
        "name": "shardwise", "credentials": [{"accessKey": S3_KEYS["AWS_ACCESS_KEY_ID"],
                                              "secretKey": S3_KEYS["AWS_SECRET_ACCESS_KEY"]}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
    ip = cluster.ip("storage")
    cluster.popen("storage", [
        weed, "server", "-s3", "-ip", ip, "-ip.bind", ip, "-dir", str(folder / "data"),
        "-s3.config", str(folder / "s3.json"), "-master.telemetry=false", "-master.volumeSizeLimitMB", "64",
        "-volume.max", "0", f"-s3.port={S3_PORT}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        # its default floor, 1% of the disk, turns every volume read-only on a large, nearly full
        # disk, and a PUT then times out instead of failing
        "-volume.minFreeSpace", "256MiB",
        "-metricsPort=0"], log=folder / "weed.log", cwd=folder)
    endpoint = f"http://{ip}:{S3_PORT}"
    try:
        cluster.run("storage", [sys.executable, "-c", _READY, endpoint + "/", str(timeout)],
                    timeout=timeout + 5)
    except RuntimeError as e:
        raise ClusterError(f"weed server -s3 on the storage host: {e}\n"
                           f"{(folder / 'weed.log').read_text(errors='replace')[-3000:]}") from e
    env = {"AWS_ENDPOINT_URL": endpoint, **S3_KEYS, "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true",
           "AWS_EC2_METADATA_DISABLED": "true"}
    if buckets:
        cluster.run("storage", [sys.executable, "-c", _BUCKETS, *buckets], timeout=timeout, env=env)
    return env


__all__ = ["Cluster", "ClusterError", "NodeRun", "remove_leftovers", "start_seaweedfs", "unavailable"]
