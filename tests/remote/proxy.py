"""The tests' own fault-injecting HTTP/1.1 proxy, put between a client and a real server.

It forwards each request whole and reads each response whole, so it can count what the client
received (``requests``: one record per request, ``received``: body bytes sent back per client
connection) and replace what the server said by a fault the test queued with :meth:`fault`:

- ``"503"``: a 503 SlowDown answer instead of forwarding (throttling);
- ``"reset"``: the headers and half the body, then a TCP reset (a connection reset mid-body);
- ``"truncate"``: the headers with the full Content-Length, half the body, then a close;
- ``"short"``: a well-formed answer whose body and Content-Length are cut by half (a short
  read nothing in HTTP detects; only the client's own length check does);
- ``"delay"``: wait ``seconds`` before answering (past the client's timeout);
- ``"nobucket"``: a 404 NoSuchBucket answer instead of forwarding (what AWS S3 answers every
  request to a bucket that does not exist, a PUT too: it makes no bucket on a write).

``host="upstream"`` sends the server's own Host header (fake-gcs-server routes its XML API by
host); the S3 gateway gets the client's (it is signed). ``gcs_put=True`` marks a PUT as the
signed upload that fake-gcs-server takes over its XML API (it has no other XML PUT), turns an
XML-API copy (a PUT with ``x-goog-copy-source``, which it lacks) into its JSON API's ``copyTo``,
and gives their answers the ETag header the XML API sends.
"""

from __future__ import annotations

import http.client
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


_CANNED = {  # the faults answered in place of the server: status, reason, XML body
    "503": (503, "Slow Down", b"<?xml version='1.0'?><Error><Code>SlowDown</Code><Message>Reduce your "
                              b"request rate</Message></Error>"),
    "nobucket": (404, "Not Found", b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchBucket'
                                   b"</Code><Message>The specified bucket does not exist</Message></Error>"),
}


@dataclass
class Record:
    method: str
    path: str
    status: int
    sent: int          # body bytes sent to the client
    fault: str | None
    headers: dict      # the request's headers, lower-cased names


@dataclass
class _Fault:
    kind: str
    method: str | None
    path: str | None
    times: int
    seconds: float
    start: int | None = None


def _json_copy(source: str, target: str) -> str:
    """The JSON-API ``copyTo`` path of an XML-API copy of ``/bucket/source`` to ``target``."""
    src_bucket, _, src = unquote(source).lstrip("/").partition("/")
    dst_bucket, _, dst = unquote(target.partition("?")[0]).lstrip("/").partition("/")
    return f"/storage/v1/b/{src_bucket}/o/{quote(src, safe='')}/copyTo/b/{dst_bucket}/o/{quote(dst, safe='')}"


class Proxy:
    def __init__(self, upstream: str, *, host: str = "client", gcs_put: bool = False):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.host_mode, self.gcs_put = host, gcs_put
        self.requests: list[Record] = []
        self.received: dict[int, int] = {}
        self.taken: list[str] = []  # the faults thrown, in order
        self._open = 0  # client connections being served
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                proxy._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    # --- what the tests use ------------------------------------------------------------------

    def fault(self, kind: str, *, method: str | None = None, path: str | None = None, times: int = 1,
              seconds: float = 0.0, start: int | None = None) -> None:
        """Queue ``times`` faults of ``kind`` for the next requests matching ``method`` and
        (a substring of) ``path``, decoded; with ``start``, only ranged requests from that byte
        on (a file's data, not its header)."""
        assert kind in ("503", "reset", "truncate", "short", "delay", "nobucket"), kind
        with self._lock:
            self._faults.append(_Fault(kind, method, path, times, seconds, start))

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
            self.taken.clear()
            self.requests.clear()
            self.received.clear()

    def pending(self) -> int:
        with self._lock:
            return sum(f.times for f in self._faults)

    def sent(self, method: str = "GET") -> int:
        """Body bytes the server's answers to ``method`` carried to the clients."""
        with self._lock:
            return sum(r.sent for r in self.requests if r.method == method)

    def count(self, method: str, path: str = "") -> int:
        with self._lock:
            return sum(1 for r in self.requests if r.method == method and path in unquote(r.path))

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until every client connection has ended: a killed client's requests that had
        reached the proxy are then answered by the server, as a real one would (their
        bodies had arrived)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._open == 0:
                    return
            time.sleep(0.01)
        raise AssertionError(f"{self._open} connections still open after {timeout} s")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # --- the proxy ---------------------------------------------------------------------------

    def _take(self, method: str, path: str, headers: dict) -> _Fault | None:
        path = unquote(path)  # GCS's XML API encodes "/", "-" and "."
        first = headers.get("range", "").removeprefix("bytes=").split("-")[0]
        with self._lock:
            for f in self._faults:
                if f.start is not None and not (first.isdigit() and int(first) >= f.start):
                    continue
                if (f.method is None or f.method == method) and (f.path is None or f.path in path):
                    f.times -= 1
                    self.taken.append(f.kind)
                    if f.times == 0:
                        self._faults.remove(f)
                    return f
        return None

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        upstream = http.client.HTTPConnection(*self.upstream, timeout=120)
        cid = id(conn)
        with self._lock:
            self._open += 1
        try:
            while True:
                line = reader.readline()
                if not line or not line.strip():
                    return
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers: list[tuple[str, str]] = []
                while (h := reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = h.decode("latin-1").partition(":")
                    headers.append((name.strip(), value.strip()))
                lower = {k.lower(): v for k, v in headers}
                body = self._body(reader, lower)
                if not self._answer(conn, upstream, cid, method, target, headers, lower, body):
                    return
        except (OSError, ValueError):
            return
        finally:
            upstream.close()
            try:
                conn.close()
            except OSError:
                pass
            with self._lock:
                self._open -= 1

    @staticmethod
    def _body(reader, headers: dict) -> bytes:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            out = bytearray()
            while (size := int(reader.readline().split(b";")[0], 16)) > 0:
                out += reader.read(size)
                reader.readline()
            while reader.readline() not in (b"\r\n", b"\n", b""):
                pass
            return bytes(out)
        return reader.read(int(headers.get("content-length", 0) or 0))

    def _answer(self, conn, upstream, cid, method, target, headers, lower, body) -> bool:
        """Forward one request and answer it; False when the connection is to be dropped."""
        fault = self._take(method, target, lower)
        kind = fault.kind if fault else None
        if kind == "delay":
            time.sleep(fault.seconds)
        if kind in _CANNED:
            status, reason, payload = _CANNED[kind]
            self._record(cid, method, target, status, len(payload), kind, lower)
            body = b"" if method == "HEAD" else payload
            conn.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: "
                         f"{len(body)}\r\n\r\n".encode() + body)
            return True
        if self.gcs_put and method == "PUT" and "x-goog-copy-source" in lower:
            method, target = "POST", _json_copy(lower["x-goog-copy-source"], target)
        elif self.gcs_put and method == "PUT" and "uploadId=" not in target:
            target += ("&" if "?" in target else "?") + "X-Goog-Algorithm=GOOG4-RSA-SHA256"
        out = [(k, v) for k, v in headers if k.lower() not in _HOP and k.lower() != "content-length"]
        if self.host_mode == "upstream":
            out = [(k, v) for k, v in out if k.lower() != "host"] + [("Host", "{}:{}".format(*self.upstream))]
        upstream.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
        for k, v in out:
            upstream.putheader(k, v)
        if body or method in ("PUT", "POST"):
            upstream.putheader("Content-Length", str(len(body)))
        upstream.endheaders(body)
        response = upstream.getresponse()
        data = response.read()
        status = response.status
        if kind == "short" and data:
            data = data[: len(data) // 2]
        head = [f"HTTP/1.1 {status} {response.reason}"]
        head += [f"{k}: {v}" for k, v in response.getheaders() if k.lower() not in _HOP
                 and k.lower() != "content-length"]
        if self.gcs_put and method in ("PUT", "POST") and status == 200 and not response.getheader("etag"):
            import json  # the signed upload answers the object's JSON, where the XML API has an ETag

            head.append(f'ETag: "{json.loads(data).get("etag", "")}"')
        length = response.getheader("content-length") if method == "HEAD" else str(len(data))
        if length is not None:
            head.append(f"Content-Length: {length}")
        cut = kind in ("reset", "truncate") and len(data) > 1
        body = b"" if method == "HEAD" else data[: len(data) // 2] if cut else data
        # recorded before it is sent: a client that has its answer finds it counted
        self._record(cid, method, target, status, len(body), kind, lower)
        conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        if cut and kind == "reset":  # SO_LINGER 0: close() sends RST
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return not cut

    def _record(self, cid, method, target, status, sent, kind, headers) -> None:
        with self._lock:
            self.requests.append(Record(method, target, status, sent, kind, headers))
            self.received[cid] = self.received.get(cid, 0) + sent


class RankProxies:
    """One :class:`Proxy` per rank in front of ``endpoint``, so that each rank's traffic is
    counted apart; :meth:`options` gives rank ``r`` its own endpoint."""

    def __init__(self, endpoint: str, world: int):
        self.proxies = [Proxy(endpoint) for _ in range(world)]

    def __enter__(self) -> RankProxies:
        return self

    def __exit__(self, *exc) -> None:
        for p in self.proxies:
            p.close()

    def options(self, base: dict) -> list[dict]:
        return [{**base, "endpoint": p.endpoint} for p in self.proxies]

    def figures(self, starts: dict[str, int]) -> tuple[list[int], list[int], list[int]]:
        """Per rank: body bytes of every GET, of the GETs of tensor data (at or past
        ``starts[file]``, where each file's data section begins) and the number of GETs."""
        fetched = [p.sent("GET") for p in self.proxies]
        data = [_data_bytes(p, starts) for p in self.proxies]
        return fetched, data, [p.count("GET") for p in self.proxies]


def _data_bytes(proxy: Proxy, starts: dict[str, int]) -> int:
    out = 0
    for r in proxy.requests:
        name = unquote(r.path).split("?")[0].rsplit("/", 1)[-1]
        if r.method == "GET" and name in starts and r.headers.get("range"):
            first = int(r.headers["range"].removeprefix("bytes=").split("-")[0])
            out += r.sent if first >= starts[name] else 0
    return out


__all__ = ["Proxy", "RankProxies", "Record"]
