"""What the tests, the benchmarks and the validation suite share, so that none of them reaches
into a private module: rank launch, memory figures, expected shards, a streaming checkpoint
writer. Never imported by ``import shardwise``.

>>> from shardwise import testing
>>> testing.spawn(lambda: 1, 2)                                    # doctest: +SKIP
[1, 1]
>>> testing.parse_size("1GiB")
1073741824"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

import shardwise as sw
from shardwise import comm
from shardwise.backends import shutdown_backend
from shardwise.core.header import dtype_to_str, spec_nbytes
from shardwise.core.plan import resolve_plan as plan_specs
from shardwise.core.quant import QuantScheme, quantize_fp8_blocks
from shardwise.core.quant_layout import DEQUANT_CHUNK, dequantize_shard, scale_layout, take_layout
from shardwise.core.spec import Region, ShardSpec
from shardwise.core.spec import split as expected_shard
from shardwise.errors import ShardwiseError, UsageError
from shardwise.holding import local_of as local_shard
from shardwise.io import info
from shardwise.io.formats import FORMATS, get_format, open_source
from shardwise.io.formats.safetensors.files import StreamingWriter, index_json, parse_size, plan_files
from shardwise.io.read import exchange, exchange_plan, fetch
from shardwise.io.storage import locate, write_small
from shardwise.parallel import ShardState, get_shard_state

# Ranks fork from a server that already imported torch: a rank starts in well under a second.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor.parallel", "shardwise"]


class RankFailure(ShardwiseError, RuntimeError):
    """One or more ranks raised, died or timed out; ``failures`` maps rank -> report."""

    def __init__(self, message: str, failures: dict[int, str]):
        self.failures = failures
        detail = "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(failures.items()))
        super().__init__(f"{message}\n{detail}")


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _rank_main(fn, args, kwargs, rank, world_size, port, env, queue):
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    try:
        threads = env.get("OMP_NUM_THREADS")
        if threads:
            torch.set_num_threads(int(threads))
        result = fn(*args, **kwargs)
        queue.put((rank, True, result))
    except BaseException:  # report everything, KeyboardInterrupt included, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            shutdown_backend()
        except Exception:  # the group may be broken already; the parent has the report
            pass


def spawn(fn: Callable[..., Any], world_size: int, *, args: tuple = (), kwargs: dict | None = None,
          timeout: float = 120.0, env: dict[str, str] | None = None,
          threads_per_rank: int | None = 1) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` (a module-level function, its result picklable) on
    ``world_size`` local ranks; return the results in rank order, else raise ``RankFailure``.

    >>> spawn(my_check, 4, args=(model_size,))   # doctest: +SKIP
    [None, None, None, None]
    """
    if world_size < 1:
        raise UsageError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    child_env = dict(env or {})
    if threads_per_rank:
        child_env.setdefault("OMP_NUM_THREADS", str(threads_per_rank))
    procs = []
    for rank in range(world_size):
        p = ctx.Process(target=_rank_main, name=f"shardwise-rank{rank}",
                        args=(fn, args, kwargs or {}, rank, world_size, port, child_env, queue))
        p.start()
        procs.append(p)
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size and (remaining := deadline - time.monotonic()) > 0:
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 0.5))
                (results if ok else failures)[rank] = payload
            except Exception:  # queue.Empty: check for ranks that died without a report
                for rank, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and rank not in results and rank not in failures:
                        failures[rank] = f"process died with exit code {p.exitcode} (killed or crashed)"
            if failures and deadline > (grace := time.monotonic() + 2.0):
                deadline = grace  # give the others a moment to report their own error, then stop them
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        queue.close()
    if failures:
        raise RankFailure(f"{len(failures)} of {world_size} rank(s) failed", failures)
    if len(results) < world_size:
        hung = {r: f"still running after {timeout:.0f} s: killed (a hung collective?)"
                for r in range(world_size) if r not in results}
        raise RankFailure(f"{len(hung)} of {world_size} rank(s) timed out", hung)
    return [results[r] for r in range(world_size)]


# -- memory ---------------------------------------------------------------------------------

def memory_status() -> dict[str, int]:
    """``VmRSS`` / ``VmHWM`` of this process in bytes; empty where /proc is missing."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def reset_high_water_mark() -> bool:
    """Reset ``VmHWM`` to the current RSS (``/proc/self/clear_refs``); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    st = memory_status()
    # RSS counters are batched per CPU: a little slack between the two fields
    return "VmHWM" in st and st["VmHWM"] <= st.get("VmRSS", 0) + (1 << 20)


class PeakMemory:
    """``peak.bytes``: the highest RSS of this process inside the block minus the RSS at entry;
    ``method``: ``"VmHWM"`` (exact), ``"sampled"`` (every ``interval`` s: a lower bound) or
    ``"none"`` (no /proc).

    >>> with PeakMemory() as peak:
    ...     block = bytearray(50 << 20)
    >>> peak.bytes >= 50 << 20 or peak.method == "none"
    True
    """

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.baseline = 0
        self.bytes = 0
        self.method = "none"
        self._max = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        self._max = max(self._max, memory_status().get("VmRSS", 0))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> PeakMemory:
        exact = reset_high_water_mark()
        self.baseline = self._max = memory_status().get("VmRSS", 0)
        if exact:
            self.method = "VmHWM"
        elif self.baseline:
            self.method = "sampled"
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="shardwise-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._sample()
        peak = memory_status().get("VmHWM", 0) if self.method == "VmHWM" else 0
        self.bytes = max(0, max(peak, self._max) - self.baseline)


def shard_state(model: nn.Module) -> ShardState:
    """What ``sw.load`` / ``sw.parallelize`` left on ``model``: its specs, degrees and ranks."""
    state = get_shard_state(model)
    if state is None:
        raise UsageError(f"{type(model).__name__} was not loaded or parallelized by shardwise")
    return state


def expected_scale_shard(scale: torch.Tensor, tie, spec: ShardSpec, degree: int, rank: int,
                         shape: tuple[int, ...]) -> torch.Tensor:
    """Rank ``rank``'s local block scales (of ``shape``) of the quantized pair ``tie``."""
    return take_layout(scale, scale_layout(tie, spec, degree, rank), shape)


def dequantized_shard(weight: torch.Tensor, scale: torch.Tensor, tie, spec: ShardSpec, degree: int,
                      rank: int, dtype: torch.dtype, *, chunk_elements: int = DEQUANT_CHUNK) -> torch.Tensor:
    """A rank's FP8 weight shard and its local scales (``scale_layout``) in ``dtype``, as
    ``dequantize=True`` gives, in dim-0 chunks of about ``chunk_elements`` elements."""
    scheme = QuantScheme(tie.scheme, tie.block)  # PlanError for an MXFP4 tie (on its packed blocks)
    return dequantize_shard(weight, scale, scheme, tie.weight_shape, spec, degree, rank, dtype,
                            chunk_elements=chunk_elements)


def read_all(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path`` (any format), whole, in one process."""
    source = open_source(locate(path))
    try:
        return {name: source.read_box(name, Region((0,) * len(shape), tuple(shape)))
                for name, (_, shape) in source.tensors().items()}
    finally:
        source.close()


def preload() -> None:
    """Import every module the public verbs import on first use, so that a timing measures the
    call, not the imports."""
    # load_optimizer: the DCP format's modules and torch.distributed.checkpoint
    for name in ("load", "save", "consolidate", "verify", "diff", "inspect", "from_pretrained",
                 "load_optimizer"):
        getattr(sw, name)
    for name in FORMATS:  # every format plugin, through the registry
        get_format(name)


def write_checkpoint(folder: str | os.PathLike, tensors: Iterable[tuple[str, torch.Tensor]],
                     shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *,
                     max_shard_size: int | str, metadata: dict | None = None) -> list[Path]:
    """Write a sharded safetensors checkpoint (files and index) into ``folder`` one tensor at a
    time: ``shapes`` names every tensor (shape, dtype) in file order, ``tensors`` yields them
    in that order. ``metadata`` goes into the index. Returns the files written."""
    specs = [(name, dtype_to_str(dtype), tuple(shape)) for name, (shape, dtype) in shapes.items()]
    file_plan = plan_files(specs, max_shard_size)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    it = iter(tensors)
    files = []
    for fname, group in file_plan:
        with StreamingWriter(folder / fname, group) as writer:
            for name, _, _ in group:
                got, tensor = next(it)
                if got != name:
                    raise UsageError(f"write_checkpoint: tensor {got!r} given where {name!r} comes next")
                writer.write(name, tensor)
        files.append(folder / fname)
    total = sum(spec_nbytes(dtype, shape) for _, dtype, shape in specs)
    index = folder / "model.safetensors.index.json"
    text = json.dumps(index_json(file_plan, total, metadata), indent=1)
    write_small(locate(index), text.encode())
    return files


@contextlib.contextmanager
def without_checksums() -> Iterator[None]:
    """Saves inside record a digest of nothing: for measuring what checksums cost (``verify``
    fails on them)."""
    class _NoDigest:
        def update(self, buf) -> None:
            pass

        def hexdigest(self) -> str:
            return "0" * 16

    real = info.DIGESTS[info.ALGORITHM]
    info.DIGESTS[info.ALGORITHM] = (_NoDigest, 16)
    try:
        yield
    finally:
        info.DIGESTS[info.ALGORITHM] = real



@contextlib.contextmanager
def exchange_probe(round_bytes: int | None = None, depth: int | None = None,
                   settings: dict[str, int] | None = None) -> Iterator[list[tuple[float, float]]]:
    """The ``(start, end)`` ``time.perf_counter`` seconds of each all-to-all of a load's exchange
    of rowwise pieces, collected while inside; ``round_bytes`` sets the exchange's round size there,
    ``depth`` the rounds it fetches ahead and ``settings`` any other of its constants by name
    (``MIN_ROUNDS``, ``MIN_SLAB``, ``SLAB_PART``): a benchmark's trial of another setting."""
    spans: list[tuple[float, float]] = []
    real = comm.all_to_all_single
    named = {"ROUND_BYTES": round_bytes, "DEPTH": depth, **(settings or {})}
    where = {name: next(m for m in (exchange, exchange_plan, fetch) if hasattr(m, name))  # the reader's
             for name, value in named.items() if value}
    saved = {name: getattr(module, name) for name, module in where.items()}

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spans.append((start, time.perf_counter()))

    comm.all_to_all_single = timed
    for name, module in where.items():
        setattr(module, name, named[name])
    try:
        yield spans
    finally:
        comm.all_to_all_single = real
        for name, module in where.items():
            setattr(module, name, saved[name])

__all__ = ["PeakMemory", "RankFailure", "dequantized_shard", "exchange_probe", "expected_scale_shard",
           "expected_shard", "free_port", "local_shard", "memory_status", "parse_size", "plan_specs",
           "preload", "quantize_fp8_blocks", "read_all", "reset_high_water_mark", "shard_state", "spawn",
           "without_checksums", "write_checkpoint"]
