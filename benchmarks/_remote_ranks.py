"""What the ranks of benchmarks/remote.py run (module level, so that spawn can pickle them):
the raw obstore client of the ceilings, and one function per method. See remote.py's docstring.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from _common import PeakRSS, bench_model, real_plan

from shardwise.testing import expected_shard

BUCKET, PREFIX = "shardwise-bench", "ckpt"
PART, CONCURRENCY = 8 << 20, 16  # shardwise's defaults for object stores (docs/guide.md)


# --- the raw client ---------------------------------------------------------------------------

def _store():
    from datetime import timedelta

    from obstore.store import S3Store

    # endpoint, keys and region from the AWS_* variables, as shardwise and runai read them
    return S3Store(BUCKET, client_options={"allow_http": True, "timeout": timedelta(seconds=120)})


def parts_of(spans, part: int = PART) -> list[tuple[str, int, int]]:
    """``(key, start, end)`` GETs of at most ``part`` bytes covering ``spans``, neighbours merged."""
    out: list[tuple[str, int, int]] = []
    merged: list[list] = []
    for key, start, end in sorted(spans):
        if merged and merged[-1][0] == key and merged[-1][2] == start:
            merged[-1][2] = end
        else:
            merged.append([key, start, end])
    for key, start, end in merged:
        out += [(key, a, min(a + part, end)) for a in range(start, end, part)]
    return out


def _fetch(parts, sink=None) -> list:
    """GET every part, ``CONCURRENCY`` in flight; keep the bodies, or hand each to ``sink``."""
    import obstore

    store = _store()

    def one(job):
        key, start, end = job
        body = obstore.get(store, key, options={"range": (start, end)}).bytes()
        if len(body) != end - start:
            raise RuntimeError(f"{key} [{start}, {end}): {len(body)} bytes")
        return sink(job, body) if sink else body

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(one, parts))


class _CountGets:
    """Count the ``obstore.get`` calls of this process (every ranged GET shardwise and the raw
    ceiling make) and their bytes, by wrapping the function for the block's duration."""

    def __enter__(self) -> _CountGets:
        import obstore

        self.requests = self.bytes = 0
        self._real, lock = obstore.get, threading.Lock()

        def get(store, key, *args, options=None, **kwargs):
            result = self._real(store, key, *args, options=options, **kwargs)
            span = (options or {}).get("range")
            with lock:
                self.requests += 1
                self.bytes += span[1] - span[0] if span else result.meta["size"]
            return result

        obstore.get = get
        return self

    def __exit__(self, *exc) -> None:
        import obstore

        obstore.get = self._real


def put(key: str, data: bytes) -> None:
    import obstore

    obstore.put(_store(), key, data, use_multipart=True, chunk_size=PART, max_concurrency=CONCURRENCY)


# --- what each rank runs (module level, so spawn can pickle them) ---------------------------

def _start(degree: int, cfg: dict):
    """The rank's backend, its tp mesh and a meta-device model; every import a load makes done."""
    import shardwise as sw
    from shardwise import testing

    backend = sw.init_backend("gloo")
    testing.preload()
    with torch.device("meta"):
        model = bench_model(cfg["num_layers"], cfg["hidden"], cfg["vocab"], dtype=torch.bfloat16)
    return backend, backend.mesh(tp=degree), model


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _local(model) -> list[torch.Tensor]:
    from shardwise.testing import local_shard

    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"{len(left)} parameters left on the meta device, e.g. {left[:3]}")
    return [local_shard(p.detach()) for p in model.parameters()]


def _figures(backend, seconds: float, peak: PeakRSS, share: int, **extra) -> dict:
    return {"rank": backend.rank, "seconds": seconds, "share": share, **peak.as_dict(), **extra}


def raw_rank(parts_by_rank: list, cfg: dict, degree: int) -> dict:
    backend, _, _ = _start(degree, cfg)
    parts = parts_by_rank[backend.rank]
    backend.barrier()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        bodies = _fetch(parts)
        seconds = time.perf_counter() - t0
    return _figures(backend, seconds, peak, sum(len(b) for b in bodies), requests=len(parts))


def shardwise_rank(url: str, cfg: dict, plan: dict, degree: int, save: dict | None) -> dict:
    import shardwise as sw

    backend, mesh, model = _start(degree, cfg)
    backend.barrier()
    with PeakRSS() as peak, _CountGets() as gets:
        t0 = time.perf_counter()
        result = sw.load(model, url, plan=real_plan(plan), mesh=mesh)
        seconds = time.perf_counter() - t0
    figures = _figures(backend, seconds, peak, _nbytes(_local(model)), bytes_read=result.bytes_read,
                       requests=gets.requests, request_bytes=gets.bytes)
    if save:
        figures["saves"] = _saves(backend, model, degree, **save)
    return figures


def _timed(backend, fn) -> dict:
    backend.barrier()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
    backend.barrier()
    return {"seconds": seconds, **peak.as_dict()}


def _saves(backend, model, degree: int, total: int, tag: str, runs: int = 2) -> dict:
    """The save phases on a loaded model: the raw puts, then sw.save gathered and distributed."""
    import shardwise as sw

    def upload(key: str, size: int):  # random bytes, made before the timer
        data = bytes(torch.empty(size, dtype=torch.uint8).random_().numpy()) if size else b""
        return lambda: data and put(key, data)

    def copy():  # a server-side copy of the gathered object, as sw.save's publish makes
        import obstore

        if rank == 0:
            obstore.copy(_store(), f"raw/{tag}-gather-0", f"raw/{tag}-gather-copy")

    # each raw put and each sw.save runs `runs` times, alternating (the fastest of each counts):
    # on a shared machine one run alone can be 2-4x off
    rank, out = backend.rank, {}
    for kind, size, key, options in (("gather", total if rank == 0 else 0, "gather", {}),
                                     ("distributed", total // degree, f"dist-{rank}", {"distributed": True})):
        out[f"raw {kind}"], out[kind] = [], []
        for i in range(runs):  # each side `runs` times, alternating (a fresh, empty prefix for each save)
            out[f"raw {kind}"].append(_timed(backend, upload(f"raw/{tag}-{key}-{i}", size)))
            if kind == "gather" and i == 0:
                out["raw copy"] = _timed(backend, copy)
            with _SaveTrace() as tr:
                out[kind].append(_timed(backend, lambda o=options, k=kind, i=i: sw.save(
                    model, f"s3://{BUCKET}/save/{tag}-{k}-{i}", overwrite=True, progress=False, **o)))
            out[kind][-1]["trace"] = tr.events
    return out


class _SaveTrace:
    """Each object-store request and each torch.distributed collective a save makes, timed from
    outside shardwise (the modules' functions wrapped for the save's duration): ``events`` are
    ``(start s, seconds, call, key)``, in the JSON beside the save's figures."""

    def __enter__(self):
        import obstore
        import torch.distributed as dist
        self.events, self.t0, self.saved = [], time.perf_counter(), []

        def wrap(owner, name):
            real = getattr(owner, name)
            def f(*a, **k):
                t = time.perf_counter()
                try:
                    return real(*a, **k)
                finally:
                    key = a[1] if owner is obstore and len(a) > 1 else ""
                    took = round(time.perf_counter() - t, 4)
                    self.events.append((round(t - self.t0, 4), took, name, str(key)[-48:]))
            self.saved.append((owner, name, real))
            setattr(owner, name, f)

        for n in ("put", "get", "head", "delete", "copy", "list", "list_with_delimiter"):
            wrap(obstore, n)
        for n in ("all_gather_object", "gather_object", "broadcast_object_list", "all_reduce", "barrier",
                  "all_gather", "reduce_scatter_tensor", "scatter_object_list", "broadcast", "gather"):
            if hasattr(dist, n):
                wrap(dist, n)
        return self

    def __exit__(self, *e):
        for owner, name, real in self.saved:
            setattr(owner, name, real)


def runai_rank(urls: list[str], cfg: dict, specs: dict, degree: int, distributed: bool | None = None) -> dict:
    """``distributed`` (default: at tp > 1): its distributed mode, which gloo needs turned on."""
    distributed = degree > 1 if distributed is None else distributed
    if distributed:  # its distributed mode; "auto" enables it on nccl only
        os.environ["RUNAI_STREAMER_DIST"] = "1"
    from runai_model_streamer import SafetensorsStreamer

    backend, _, _ = _start(degree, cfg)
    rank = backend.rank
    local: dict[str, torch.Tensor] = {}
    backend.barrier()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(urls, device="cpu", is_distributed=distributed)
            distributed = streamer.file_streamer.is_distributed
            for name, tensor in streamer.get_tensors():
                spec = specs.get(name)
                local[name] = tensor if spec is None else expected_shard(tensor, spec, degree, rank)
                del tensor
        seconds = time.perf_counter() - t0
    return _figures(backend, seconds, peak, _nbytes(local.values()), tensors=len(local),
                    distributed=distributed)


def download_rank(files: list[tuple[str, int]], folder: str, cfg: dict, plan: dict, degree: int) -> dict:
    """Download the rank's files (file i by rank i % N, ranged GETs), then sw.load the folder."""
    import shardwise as sw

    backend, mesh, model = _start(degree, cfg)
    rank = backend.rank
    mine = [(key, size) for i, (key, size) in enumerate(files) if i % degree == rank]
    backend.barrier()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        fds = {key: os.open(Path(folder) / Path(key).name, os.O_WRONLY | os.O_CREAT, 0o644)
               for key, _ in mine}
        parts = parts_of([(key, 0, size) for key, size in mine])
        try:
            _fetch(parts, sink=lambda job, body: os.pwrite(fds[job[0]], body, job[1]))
        finally:
            for fd in fds.values():
                os.close(fd)
        backend.barrier()
        download = time.perf_counter() - t0
        sw.load(model, folder, plan=real_plan(plan), mesh=mesh)
        seconds = time.perf_counter() - t0
        local = _local(model)
        t1 = time.perf_counter()
        for t in local:  # one byte of every page of the zero-copy views
            t.reshape(-1).view(torch.uint8)[::4096].sum()
        touch = time.perf_counter() - t1
    return _figures(backend, seconds, peak, _nbytes(local), download_s=download, touch_s=touch,
                    requests=len(parts))
