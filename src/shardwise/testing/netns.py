"""The pieces the simulated cluster (``shardwise.testing.cluster``) is built of: Linux network
namespaces, veth cables plugged into a bridge, ``tbf`` rates, the kernel's NIC counters, and the
clean-up of what a crashed run left. Linux only, as root, with iproute2 and util-linux."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from shardwise.errors import ShardwiseError

QUEUE_SECONDS = 0.25
MTU = 9000  # jumbo frames, as a cluster's fabric: headers stay under 1% of a counted byte
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


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def tbf(ns: str, dev: str, mbit: float | None) -> None:
    """Limit what ``dev`` in ``ns`` sends to ``mbit`` (None: unlimited), with a queue of
    ``QUEUE_SECONDS`` of the rate (shallower queues drop packets and make even a raw download
    erratic)."""
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


def plug(switch: str, bridge: str, port: str, ns: str, dev: str, address: str) -> None:
    """A veth cable from ``bridge`` (port ``port``, in namespace ``switch``) to ``dev`` in
    ``ns``, up, at ``address`` (with its prefix length)."""
    ip("-n", switch, "link", "add", port, "mtu", str(MTU), "type", "veth", "peer", "name", dev, "netns", ns)
    ip("-n", switch, "link", "set", port, "master", bridge, "up")
    ip("-n", ns, "link", "set", dev, "mtu", str(MTU), "up")
    ip("-n", ns, "addr", "add", address, "dev", dev)


def counters(ns: str, dev: str) -> dict[str, int]:
    """The bytes and packets ``dev`` in ``ns`` has received and sent, as the kernel counts them."""
    stats = json.loads(ip("-n", ns, "-s", "-j", "link", "show", "dev", dev).stdout)[0]
    s = stats["stats64"]
    return {"rx_bytes": s["rx"]["bytes"], "tx_bytes": s["tx"]["bytes"],
            "rx_packets": s["rx"]["packets"], "tx_packets": s["tx"]["packets"],
            "tx_dropped": s["tx"]["dropped"]}


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def kill_in(ns: str) -> list[int]:
    """SIGKILL the processes in namespace ``ns``, by their ids; the ids."""
    pids = [int(p) for p in ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def remove_namespace(ns: str) -> None:
    """Kill the processes left in ``ns``, then delete it."""
    pids = kill_in(ns)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    ip("netns", "del", ns, check=False)


def _stale(name: str, prefix: str) -> bool:
    owner = name[len(prefix):].split("-")[0]
    return name.startswith(prefix) and owner.isdigit() and not alive(int(owner))


def remove_leftovers(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces ``{prefix}{pid}-*`` whose process ``pid`` is gone (a crashed run),
    and its folders in /var/tmp."""
    gone = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if _stale(name, prefix):
            remove_namespace(name)
            gone.append(name)
    for folder in Path("/var/tmp").glob(f"{prefix}*-*"):
        if _stale(folder.name, prefix) and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(str(folder))
    return gone
