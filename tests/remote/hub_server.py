"""A local stand-in for the Hugging Face hub, started by the tests: it serves folders as model
repositories, answering the calls huggingface_hub makes for them (found in its ``hf_api``,
``file_download`` and ``hf_file_system``), and counts the body bytes it sends per file.

- ``GET /api/models/{repo}/revision/{revision}``: the repo's info (``id``, ``sha``, ``siblings``);
- ``GET /api/models/{repo}/tree/{revision}[/{path}]``: the entries under ``path`` (``recursive``);
- ``POST /api/models/{repo}/paths-info/{revision}``: the entries of the form's ``paths``;
- ``HEAD`` / ``GET /{repo}/resolve/{revision}/{path}``: the file, a ``Range: bytes=a-b`` as a 206,
  with ``ETag``, ``X-Repo-Commit``, ``Accept-Ranges`` and ``Content-Range``.

A revision is ``main`` or the repo's commit sha (a hash of its files). An unknown repo, revision
or file is a 404 with the ``X-Error-Code`` the hub sends (``RepoNotFound``, ``RevisionNotFound``,
``EntryNotFound``). With ``token`` set, a request without ``Authorization: Bearer {token}`` is a
401, as a private repo's.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class HubServer:
    """``HubServer({"org/tiny": folder})``: serving from ``start()`` to ``stop()``; ``endpoint`` is
    its URL (what ``HF_ENDPOINT`` names), ``sent`` the body bytes sent per ``repo/path``."""

    def __init__(self, repos: dict[str, Path], *, token: str | None = None):
        self.repos = {repo: Path(folder) for repo, folder in repos.items()}
        self.token = token
        self.sent: Counter[str] = Counter()
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def clear(self) -> None:
        with self._lock:
            self.sent.clear()
            self.requests.clear()

    def sha(self, repo: str) -> str:
        """The repo's commit: a hash of its file names and contents."""
        digest = hashlib.sha1()
        for path in _files(self.repos[repo]):
            digest.update(path.encode() + b"\0" + (self.repos[repo] / path).read_bytes())
        return digest.hexdigest()


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _entry(folder: Path, path: str) -> dict:
    target = folder / path
    if target.is_dir():
        return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "path": path}
    data = target.read_bytes()
    return {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": path}


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: the tests read hub.requests
            pass

        def _reply(self, status: int, body: bytes = b"", headers: dict | None = None, *, send=True) -> None:
            self.send_response(status)
            for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
                self.send_header(k, v)
            self.end_headers()
            if send and body:
                self.wfile.write(body)

        def _json(self, value) -> None:
            self._reply(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

        def _missing(self, code: str) -> None:
            self._reply(404, code.encode(), {"X-Error-Code": code, "X-Error-Message": code})

        def _repo(self, repo: str, revision: str) -> Path | None:
            """The folder of ``repo`` at ``revision``, or None having answered the 404 / 401."""
            given = self.headers.get("Authorization")
            if hub.token is not None and given != f"Bearer {hub.token}":
                # the hub's answers: a wrong token, or none for a private repo (taken as absent)
                wrong = {"X-Error-Message": "Invalid credentials in Authorization header"}
                self._reply(401, b"unauthorized", wrong if given else {"X-Error-Code": "RepoNotFound"})
                return None
            if repo not in hub.repos:
                self._missing("RepoNotFound")
                return None
            if revision not in ("main", hub.sha(repo)):
                self._missing("RevisionNotFound")
                return None
            return hub.repos[repo]

        def _route(self, method: str) -> None:
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.strip("/").split("/")]
            with hub._lock:
                hub.requests.append((method, url.path, self.headers.get("Range")))
            if parts[:2] == ["api", "models"] and len(parts) >= 6:
                repo, verb, revision, rest = "/".join(parts[2:4]), parts[4], parts[5], "/".join(parts[6:])
                folder = self._repo(repo, revision)
                if folder is None:
                    return
                if verb == "revision" and method == "GET":
                    return self._json({"id": repo, "sha": hub.sha(repo), "private": False,
                                       "siblings": [{"rfilename": f} for f in _files(folder)]})
                if verb == "tree" and method == "GET":
                    recursive = parse_qs(url.query).get("recursive", [""])[0].lower() == "true"
                    return self._tree(folder, rest, recursive)
                if verb == "paths-info" and method == "POST":
                    length = int(self.headers.get("Content-Length", 0))
                    form = parse_qs(self.rfile.read(length).decode())
                    return self._json([_entry(folder, p) for p in form.get("paths", [])
                                       if (folder / p).exists()])
            if len(parts) >= 5 and parts[2] == "resolve":
                folder = self._repo("/".join(parts[:2]), parts[3])
                if folder is not None:
                    self._file("/".join(parts[:2]), folder, "/".join(parts[4:]), method)
                return
            self._reply(404, b"no such endpoint")

        def _tree(self, folder: Path, path: str, recursive: bool) -> None:
            base = folder / path
            if not base.is_dir():
                return self._missing("EntryNotFound")
            found = base.rglob("*") if recursive else base.iterdir()
            self._json([_entry(folder, p.relative_to(folder).as_posix()) for p in sorted(found)])

        def _file(self, repo: str, folder: Path, path: str, method: str) -> None:
            target = folder / path
            if not target.is_file():
                return self._missing("EntryNotFound")
            data = target.read_bytes()
            headers = {"ETag": f'"{hashlib.sha1(data).hexdigest()}"', "X-Repo-Commit": hub.sha(repo),
                       "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            status, body = 200, data
            wanted = _RANGE.match(self.headers.get("Range", ""))
            if wanted:
                start = int(wanted.group(1))
                end = min(int(wanted.group(2)) + 1 if wanted.group(2) else len(data), len(data))
                if start >= len(data):
                    return self._reply(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                status, body = 206, data[start:end]
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            if method == "GET":
                with hub._lock:
                    hub.sent[f"{repo}/{path}"] += len(body)
            self._reply(status, body, headers, send=method == "GET")

        def do_GET(self):
            self._route("GET")

        def do_HEAD(self):
            self._route("HEAD")

        def do_POST(self):
            self._route("POST")

    return Handler
