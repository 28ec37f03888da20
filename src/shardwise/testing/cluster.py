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
routes it through loopback: the fast interconnect inside a node). A process runs "on" a host
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

from shardwise.errors import ShardwiseError, UsageError

SUBNET = "10.47.0"
STORAGE_IP = f"{SUBNET}.2"
QUEUE_SECONDS = 0.25
MTU = 9000  # jumbo frames, as a cluster's fabric: headers stay under 1% of a counted byte
RDZV_PORT = 29400
PREFIX = "swcl"


class ClusterError(ShardwiseError, RuntimeError):
    """The simulated cluster could not be made or run: a namespace, a rate, a process, the store."""


def unavailable() -> str | None:
    """Why a cluster cannot be made here (None: it can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (CI runs tests/cluster as root)"
    for tool in ("ip", "tc", "unshare", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH (iproute2 / util-linux)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def _tc(ns: str, dev: str, mbit: float | None) -> None:
    subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
    if mbit is None:
        return
    rate = mbit * 1e6 / 8  # bytes/s
    burst = max(64 << 10, int(rate / 100))  # 10 ms of the rate: smooth at HZ=100..1000
    done = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                           "burst", str(burst), "limit", str(int(rate * QUEUE_SECONDS) + burst)],
                          capture_output=True, text=True)
    if done.returncode:
        raise ClusterError(f"tc tbf on {ns}/{dev} failed: {done.stderr.strip()}")


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _kill_in(ns: str) -> list[int]:
    """SIGKILL the processes in namespace ``ns``, by their ids; the ids."""
    pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _remove_namespace(ns: str) -> None:
    """Kill the processes left in ``ns``, then delete it."""
    pids = _kill_in(ns)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    _ip("netns", "del", ns, check=False)


def _stale(name: str, prefix: str) -> bool:
    owner = name[len(prefix):].split("-")[0]
    return name.startswith(prefix) and owner.isdigit() and not _alive(int(owner))


def remove_leftovers(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces ``{prefix}{pid}-*`` whose process ``pid`` is gone (a crashed run),
    and its folders in /var/tmp."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if _stale(name, prefix):
            _remove_namespace(name)
            gone.append(name)
    for folder in Path("/var/tmp").glob(f"{prefix}*-*"):
        if _stale(folder.name, prefix) and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(str(folder))
    return gone


@dataclass(frozen=True)
class NodeRun:
    """One node's torchrun: its exit status and log (stdout and stderr)."""

    node: int
    returncode: int | None
    log: str
    seconds: float


class Cluster:
    """``nodes`` simulated nodes of ``ranks_per_node`` ranks at ``mbit`` down and up each (None:
    unlimited), and a storage host at ``storage_mbit`` (None: unlimited). ``root``: where the
    node folders and the shared folder go (not under /tmp, which each node replaces)."""

    def __init__(self, nodes: int = 2, ranks_per_node: int = 1, *, mbit: float | None = 200.0,
                 storage_mbit: float | None = None, root: str | os.PathLike | None = None,
                 prefix: str = PREFIX):
        if not 1 <= nodes <= 200 or ranks_per_node < 1:
            raise UsageError(f"nodes={nodes}, ranks_per_node={ranks_per_node}: 1-200 nodes, 1 rank or more")
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.mbit, self.storage_mbit, self.prefix = mbit, storage_mbit, prefix
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
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "mtu", str(MTU), "up")
        for where in ["storage", *range(self.nodes)]:
            ns, port = self.ns(where), "st" if where == "storage" else f"n{where}"
            self._add_namespace(ns)
            if where != "storage":
                for sub in ("tmp", "home"):
                    (self.root / f"node{where}" / sub).mkdir(parents=True, exist_ok=True)
            _ip("-n", switch, "link", "add", port, "mtu", str(MTU), "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "link", "set", "eth0", "mtu", str(MTU), "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # no IPv6 chatter (router solicitations) in the byte counters
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"],
                           capture_output=True)
            _ip("-n", ns, "addr", "add", f"{self.ip(where)}/24", "dev", "eth0")
            mbit = self.storage_mbit if where == "storage" else self.mbit
            self.rate(where, mbit, mbit)

    def _add_namespace(self, ns: str) -> None:
        _ip("netns", "add", ns)
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
            _remove_namespace(ns)
        self._namespaces.clear()
        if self.root != Path() and not self._given_root:
            shutil.rmtree(self.root, ignore_errors=True)

    # --- the links -----------------------------------------------------------------------------

    def rate(self, where: int | str, down_mbit: float | None, up_mbit: float | None) -> None:
        """Set a host's download and upload rates (None: unlimited), e.g. a slow node."""
        port = "st" if where == "storage" else f"n{where}"
        _tc(self.ns("switch"), port, down_mbit)   # the switch sends to the host: its download
        _tc(self.ns(where), "eth0", up_mbit)

    def link(self, where: int | str, up: bool) -> None:
        """Take a host's cable out (``up=False``: a partition) or put it back."""
        port = "st" if where == "storage" else f"n{where}"
        _ip("-n", self.ns("switch"), "link", "set", port, "up" if up else "down")

    def kill(self, where: int | str) -> list[int]:
        """SIGKILL every process on a host (its ranks, their torchrun): a node crash; the ids."""
        return _kill_in(self.ns(where))

    def counters(self, where: int | str) -> dict[str, int]:
        """The bytes and packets a host's NIC has received and sent (``rx_bytes``, ``tx_bytes``, ...),
        as the kernel counts them: outside every process of the host."""
        stats = json.loads(_ip("-n", self.ns(where), "-s", "-j", "link", "show", "dev", "eth0").stdout)[0]
        s = stats["stats64"]
        return {"rx_bytes": s["rx"]["bytes"], "tx_bytes": s["tx"]["bytes"],
                "rx_packets": s["rx"]["packets"], "tx_packets": s["tx"]["packets"],
                "tx_dropped": s["tx"]["dropped"]}

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
                 nodes: list[int] | None = None, ranks_per_node: int | None = None) -> list[NodeRun]:
        """``script`` (a path and its arguments) under torchrun on every node (or ``nodes``),
        ``ranks_per_node`` ranks each (default: the cluster's), joined by c10d rendezvous on node
        0's address. Each node's run ends by itself or is killed at ``timeout``; never raises for
        a failed node (a fault test expects some)."""
        chosen = list(range(self.nodes)) if nodes is None else nodes
        env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1", **(env or {})}
        procs, logs, t0 = [], [], time.monotonic()
        for node in chosen:
            log = self.root / f"node{node}-torchrun-{time.monotonic_ns()}.log"
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(chosen)),
                    "--nproc-per-node", str(ranks_per_node or self.ranks_per_node), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"{self.ip(chosen[0])}:{RDZV_PORT}", "--rdzv-id", self.tag,
                    "--local-addr", self.ip(node), "--max-restarts", "0", *script]
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


__all__ = ["Cluster", "NodeRun", "remove_leftovers", "start_seaweedfs", "unavailable"]
