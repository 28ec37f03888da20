"""Shared helpers for the scripts in ``benchmarks/``: process counters, peak memory,
page-cache control, a generated Llama-like checkpoint and its model, and result files.

``benchmarks/`` is not a package: a script run as ``python3 benchmarks/x.py`` has its own
folder on ``sys.path`` and does ``import _common``, which puts the checkout's ``src`` first
on ``sys.path`` (no PYTHONPATH needed). Sizes are decimal (1 GB = 10**9).
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    import shardwise as sw

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
# Benchmark the checkout, not whatever shardwise is installed; spawned ranks inherit sys.path.
# SHARDWISE_BENCH_SRC names another checkout's src/ (benchmarks/before_after.py measures an
# older commit with it); every shardwise import below is inside a function, so that a run
# takes shardwise from there only.
SRC = Path(os.environ.get("SHARDWISE_BENCH_SRC") or REPO / "src")
if (SRC / "shardwise").is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

INDEX_SUFFIX = ".safetensors.index.json"

OUT_DIR = BENCH_DIR / "results"  # kept in the repository, next to the docs they feed
SCRATCH_DIR = BENCH_DIR / "out"  # git-ignored: runs from a dirty tree
DOC = REPO / "docs" / "benchmarks.md"
GB = 10**9

# --- process counters ------------------------------------------------------------------------

def proc_io() -> dict[str, int]:
    """This process's ``/proc/self/io`` counters (rchar, wchar, read_bytes, write_bytes, ...).

    ``rchar`` counts bytes returned by read-like syscalls (page cache hits included);
    pages faulted in through an mmap are NOT counted. Empty dict where the file is missing.
    """
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f if ":" in line)}
    except OSError:
        return {}


def io_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """``after - before`` for every counter present in both."""
    return {k: after[k] - before[k] for k in after if k in before}


def proc_status() -> dict[str, int]:
    """The memory lines of ``/proc/self/status`` (VmRSS, VmHWM, RssAnon, RssFile...) in bytes."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("Vm", "Rss")) and line.rstrip().endswith("kB"):
                    key, value = line.split(":")
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def rss_bytes() -> int:
    """Current resident set size (VmRSS) in bytes; 0 where /proc is missing."""
    return proc_status().get("VmRSS", 0)


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (``echo 5 > /proc/self/clear_refs``); True when it worked."""
    try:
        from shardwise.testing import reset_high_water_mark
    except ModuleNotFoundError:  # a --base commit from before shardwise.testing (consolidate.py)
        from shardwise.memory import reset_high_water_mark  # type: ignore[no-redef]

    return reset_high_water_mark()


class PeakRSS:
    """Peak resident memory ABOVE the level at entry, for a block of code.

    ``ru_maxrss`` is a lifetime high-water mark, useless after an earlier phase in the
    same process. So at entry VmHWM is reset through ``/proc/self/clear_refs`` (exact;
    ``method == "VmHWM"``) and a thread samples VmRSS and RssAnon every ``interval``
    seconds as a fallback (``method == "sampled"``, a lower bound) and for the
    anonymous part, which excludes file pages mapped by mmap. Counts this process
    only (all its threads), not children.

    >>> with PeakRSS() as peak:
    ...     x = torch.ones(10**6)
    >>> peak.bytes >= 4 * 10**6
    True
    """

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.baseline = self.baseline_anon = 0
        self.bytes = self.sampled_bytes = self.anon_bytes = 0
        self.method = "sampled"
        self._max_rss = self._max_anon = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        st = proc_status()
        self._max_rss = max(self._max_rss, st.get("VmRSS", 0))
        self._max_anon = max(self._max_anon, st.get("RssAnon", 0))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> PeakRSS:
        exact = _reset_hwm()
        st = proc_status()
        self.method = "VmHWM" if exact else "sampled"
        self.baseline, self.baseline_anon = st.get("VmRSS", 0), st.get("RssAnon", 0)
        self._max_rss, self._max_anon = self.baseline, self.baseline_anon
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="PeakRSS", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.sampled_bytes = self._max_rss - self.baseline
        self.anon_bytes = self._max_anon - self.baseline_anon
        self.bytes = self.sampled_bytes
        if self.method == "VmHWM":
            # HWM is exact where the kernel updates it; the samples only ever add to it.
            self.bytes = max(proc_status().get("VmHWM", 0) - self.baseline, self.sampled_bytes)

    def as_dict(self) -> dict:
        return {"peak_rss": self.bytes, "peak_rss_sampled": self.sampled_bytes,
                "peak_anon": self.anon_bytes, "rss_method": self.method}


def mem_available() -> int:
    """MemAvailable from /proc/meminfo in bytes (free RAM plus reclaimable cache)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# --- page cache --------------------------------------------------------------------------------

def drop_file_cache(paths) -> None:
    """Best effort: ask the kernel to evict these files from the page cache.

    ``POSIX_FADV_DONTNEED`` skips dirty pages and pages another process maps, so a
    file may stay partly cached; dropping everything needs root (``drop_caches``).
    """
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_file_cache(paths, chunk: int = 64 << 20) -> int:
    """Read every file once so that it sits in the page cache; return the bytes read."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


# --- the generated checkpoint and its model ----------------------------------------------------

@functools.cache
def _toy():
    """This checkout's ``shardwise.testing.model``, also where SHARDWISE_BENCH_SRC measures
    another commit's shardwise (before_after.py, consolidate.py): both commits then load the
    same model, and a base commit older than the toy's options still runs."""
    if SRC == REPO / "src":
        from shardwise.testing import model

        return model
    spec = importlib.util.spec_from_file_location("_bench_toy", REPO / "src/shardwise/testing/model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def bench_config(num_layers: int, hidden: int, vocab: int):
    """The toy of ``shardwise.testing.model`` shaped like a Llama stack: 8 heads (no GQA, no
    q/k norms), a packed gate_up [8h, h], down [h, 4h], an untied head. ``hidden`` must divide by
    8 * 8 (degrees 1, 2, 4, 8 split whole heads)."""
    return _toy().ModelConfig(vocab=vocab, hidden=hidden, heads=8, kv_heads=8, head_dim=hidden // 8,
                       inter=4 * hidden, moe_layers=(False,) * num_layers, tie=False, qk_norm=False,
                       fused_gate_up=True)


def bench_plan() -> dict[str, str]:
    """The toy's plan for its layers (embedding and head replicated). "packed_colwise"
    stands for gate|up blocks of ratio [1, 1]: see :func:`real_plan`."""
    return {k: v for k, v in _toy().tp_plan(bench_config(1, 64, 64)).items() if ".layers." in k}


def real_plan(plan: dict[str, str]) -> dict:
    """``plan`` with library objects, as a loader call site passes it: "packed_colwise"
    becomes ``sw.PackedColwise([1, 1])``."""
    import shardwise as sw

    return {k: sw.PackedColwise([1, 1]) if v == "packed_colwise" else v for k, v in plan.items()}


def bench_model(num_layers: int, hidden: int, vocab: int, *, dtype: torch.dtype | None = None) -> nn.Module:
    """The model :func:`make_checkpoint` writes (build it under ``torch.device("meta")`` for
    ``sw.load``).

    >>> with torch.device("meta"):
    ...     m = bench_model(2, 64, 512)
    >>> m.model.layers[1].mlp.gate_up_proj.weight.shape
    torch.Size([512, 64])
    """
    model = _toy().ToyLM(bench_config(num_layers, hidden, vocab))
    return model.to(dtype) if dtype is not None else model


def checkpoint_model(path, *, dtype: torch.dtype | None = None) -> nn.Module:
    """:func:`bench_model` as described by the ``bench_config`` of a :func:`make_checkpoint` index."""
    cfg = read_bench_config(path)
    return bench_model(cfg["num_layers"], cfg["hidden"], cfg["vocab"], dtype=dtype)


def shard_specs(config: dict, plan: dict[str, str], degree: int) -> dict[str, sw.ShardSpec]:
    """ShardSpec of every sharded tensor of a :func:`make_checkpoint` model at ``degree``,
    from shardwise's own plan resolution (replicated tensors left out)."""
    from shardwise.testing import plan_specs

    with torch.device("meta"):
        model = bench_model(config["num_layers"], config["hidden"], config["vocab"])
    resolved = plan_specs(model, real_plan(plan), degree)
    return {name: spec for name, spec in resolved.items() if not spec.replicated}


def bench_tensors(num_layers: int, hidden: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of :func:`bench_model`, in checkpoint order."""
    with torch.device("meta"):
        model = bench_model(num_layers, hidden, vocab)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


@dataclass
class BenchCheckpoint:
    path: Path                                  # the folder, holding the index
    files: list[Path]
    tensors: list[tuple[str, tuple[int, ...]]]  # (name, shape) in file order
    plan: dict[str, str]
    config: dict                                # num_layers, hidden, vocab, dtype, seed, file_bytes
    total_bytes: int
    reused: bool = field(default=False)


def _index_path(folder: Path) -> Path:
    return folder / ("model" + INDEX_SUFFIX)


def read_bench_config(folder) -> dict:
    """The ``bench_config`` that :func:`make_checkpoint` stored in the index metadata."""
    with open(_index_path(Path(folder))) as f:
        return json.load(f)["metadata"]["bench_config"]


def make_checkpoint(folder, total_bytes: int, file_bytes: int, *, dtype: torch.dtype = torch.bfloat16,
                    layers: int = 8, seed: int = 0) -> BenchCheckpoint:
    """Write (or reuse) a sharded safetensors checkpoint of a Llama-like stack near ``total_bytes``.

    The tensors of :func:`bench_model`: per layer q/k/v/o [h, h], packed gate_up [8h, h],
    down [h, 4h], two norms [h]; an embedding and a head [8h, h], a final norm.
    ``h`` is the largest multiple of 64 that keeps the total under ``total_bytes``, so every
    split over 1, 2, 4 or 8 ranks is even. Tensors are generated and streamed to disk one at a
    time (peak memory ~ one tensor in float32). A checkpoint already in ``folder`` with the same
    config is reused as it is.
    """
    from shardwise.testing import write_checkpoint

    folder = Path(folder)
    item = torch.empty((), dtype=dtype).element_size()
    hidden = max(64, int(math.sqrt(total_bytes / item / (16 * layers + 16))) // 64 * 64)
    cfg = {"num_layers": layers, "hidden": hidden, "vocab": 8 * hidden,
           "dtype": str(dtype).removeprefix("torch."), "seed": seed, "file_bytes": int(file_bytes)}
    tensors = bench_tensors(layers, hidden, 8 * hidden)
    total = sum(math.prod(s) for _, s in tensors) * item

    index = _index_path(folder)
    if index.is_file():
        try:
            old = read_bench_config(folder)
            files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (KeyError, ValueError) as e:
            raise ValueError(f"{folder} holds a checkpoint index that make_checkpoint did not write; "
                             "pass an empty or new folder") from e
        if old == cfg and all(f.is_file() for f in files):
            result = BenchCheckpoint(folder, files, tensors, bench_plan(), cfg, total)
            result.reused = True
            return result
        index.unlink()
    gen = torch.Generator().manual_seed(seed)
    generated = ((n, (torch.randn(shape, generator=gen) * 0.02).to(dtype)) for n, shape in tensors)
    files = write_checkpoint(folder, generated, {n: (shape, dtype) for n, shape in tensors},
                             max_shard_size=file_bytes, metadata={"bench_config": cfg})
    return BenchCheckpoint(folder, files, tensors, bench_plan(), cfg, total)


# --- results ---------------------------------------------------------------------------------

def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


# What a benchmark itself writes: changes there do not make the measured code uncommitted.
_OUTPUTS = ("docs/", "benchmarks/results/")


def _commit() -> str:
    """HEAD's short hash, with "-dirty" when code differs from it: figures measured on
    uncommitted code must not name a commit that lacks it. Untracked files count (a new
    script not yet committed), the benchmarks' own outputs do not (a run that publishes
    two tables would otherwise refuse the second)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout

    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=all").splitlines()]
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("-dirty" if _foreign_src() or any(not p.startswith(_OUTPUTS) for p in changed) else "")


def _foreign_src() -> bool:
    """shardwise is imported from another tree's ``src/`` (``PYTHONPATH=../other/src``, as a
    comparison with an older commit does): the figures are not this tree's, its docs stay."""
    spec = importlib.util.find_spec("shardwise")
    if spec is None or not spec.origin:
        return False
    src = Path(spec.origin).resolve().parent.parent
    return src.name == "src" and src != REPO / "src"


def machine_info() -> dict:
    """Where the figures come from: CPU, cores, RAM, kernel, library versions, date, commit."""
    import numpy
    import safetensors

    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), "unknown CPU")
    thp = re.search(r"\[(\w+)\]", _read("/sys/kernel/mm/transparent_hugepage/enabled"))
    commit = _commit()
    ram = int(_read("/proc/meminfo").split()[1]) * 1024
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu, "cores": len(os.sched_getaffinity(0)), "ram_bytes": ram,
        "kernel": platform.release(), "thp": thp.group(1) if thp else "?",
        "python": platform.python_version(),
        "torch": torch.__version__, "safetensors": safetensors.__version__,
        "numpy": numpy.__version__, "commit": commit,
    }


def _cell(value, fmt: str | None) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return format(value, fmt or ".2f")
    return str(value).replace("|", "\\|")


def markdown_table(rows: list[dict], columns) -> str:
    """``columns``: (key, title) or (key, title, format) tuples, in order."""
    cols = [tuple(c) + (None,) * (3 - len(c)) for c in columns]
    lines = ["| " + " | ".join(title for _, title, _ in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(_cell(row.get(k), fmt) for k, _, fmt in cols) + " |" for row in rows]
    return "\n".join(lines)


def _replace_section(text: str, name: str, section: str) -> str:
    pattern = re.compile(rf"^## {re.escape(name)}[ \t]*\n.*?(?=^## |\Z)", re.M | re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: section, text, count=1)
    return text.rstrip("\n") + "\n\n" + section


def results_dir() -> Path:
    """Where a run saves its JSON: ``benchmarks/results/`` from a clean tree, else the
    git-ignored ``benchmarks/out/``."""
    commit = machine_info()["commit"]
    return SCRATCH_DIR if commit.endswith("-dirty") or not commit else OUT_DIR


def write_results(name: str, rows: list[dict], columns, notes: str = "", extra: dict | None = None,
                  out_dir: Path | None = None) -> str:
    """Save ``benchmarks/results/<name>.json`` (kept in the repository) and replace the
    ``## <name>`` section of ``docs/benchmarks.md`` (other sections kept; the file is
    created if missing). From a dirty tree neither is written: the JSON goes to the
    ignored ``benchmarks/out/`` and docs stay as they are, since their commit stamp would
    name a commit that does not hold the code measured.

    Returns the markdown table. ``extra`` goes into the JSON only (per-rank details...).
    ``out_dir`` overrides where the JSON goes (the docs still follow the rule above).
    """
    info = machine_info()
    dirty = info["commit"].endswith("-dirty") or not info["commit"]
    out_dir = out_dir or (SCRATCH_DIR if dirty else OUT_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"name": name, "machine": info, "columns": [list(c) for c in columns],
               "rows": rows, "notes": notes, **(extra or {})}
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")

    if dirty:
        print(f"[{name}] the work tree is dirty ({info['commit'] or 'no git'}): docs/benchmarks.md not "
              f"updated, JSON in {out_dir}/; commit, then run again to publish", file=sys.stderr)
        return markdown_table(rows, columns)
    return write_doc_section(payload)


def write_doc_section(payload: dict) -> str:
    """Replace the ``## <name>`` section of docs/benchmarks.md with a saved run (the JSON that
    :func:`write_results` wrote): its notes, its table and its machine line. Returns the table."""
    name, info, notes = payload["name"], payload["machine"], payload["notes"]
    table = markdown_table(payload["rows"], payload["columns"])
    machine = (f"{info['date']}; {info['cores']} cores ({info['cpu']}), "
               f"{info['ram_bytes'] / 2**30:.0f} GiB RAM, Linux {info['kernel']}, THP {info['thp']}; "
               f"torch {info['torch']}, safetensors {info['safetensors']}; commit {info['commit'] or '?'}")
    section = "\n\n".join(p for p in (f"## {name}", notes.strip(), table, f"_{machine}._") if p) + "\n\n"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    text = DOC.read_text() if DOC.is_file() else (
        "# Benchmarks\n\nFigures written by the scripts in `benchmarks/` (each replaces its own "
        "section; raw data in `benchmarks/results/*.json`). Run them again on your machine before "
        "quoting them: they depend on cores, memory bandwidth and the page cache.\n")
    tmp = DOC.with_name(DOC.name + ".partial")
    tmp.write_text(_replace_section(text, name, section).rstrip("\n") + "\n")
    os.replace(tmp, DOC)
    return table


# --- docs/reliability.md: the stress runs (tests/stress/stress.py) and benchmarks/checksums.py ----

RELIABILITY_DOC = REPO / "docs" / "reliability.md"
_INTRO = """# Reliability

How shardwise behaves under hostile input and crashing processes, measured by
`tests/stress/stress.py` and `benchmarks/checksums.py` (each run replaces its own section below; raw data in
`benchmarks/results/reliability-*.json`). What each outcome means is in the script's docstring;
the goal is that every row reads "ok" or "clean", and every trial and death passes.
"""



def publish_reliability(name: str, title: str, notes: str, table: str, result: dict) -> None:
    """Print a stress or checksum run's table, save its JSON and, from a clean tree, replace its
    section of docs/reliability.md."""
    info = machine_info()
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    payload = {"machine": info, "title": title, "notes": notes, "table": table, **result}
    (out / f"reliability-{name}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    print(table)
    if info["commit"].endswith("-dirty") or not info["commit"]:
        print(f"[reliability {name}] the work tree is dirty: {RELIABILITY_DOC.name} not updated, "
              f"JSON in {out}/", file=sys.stderr)
        return
    write_reliability_section(payload)


def write_reliability_section(payload: dict) -> None:
    """Replace the run's section of docs/reliability.md with ``payload`` (a saved JSON)."""
    info = payload["machine"]
    machine = (f"{info['date']}; {info['cores']} cores ({info['cpu']}); torch {info['torch']}; "
               f"commit {info['commit'] or '?'}")
    title = payload["title"]
    section = f"## {title}\n\n{payload['notes'].strip()}\n\n{payload['table']}\n\n_{machine}._\n\n"
    text = RELIABILITY_DOC.read_text() if RELIABILITY_DOC.is_file() else _INTRO
    RELIABILITY_DOC.write_text(_replace_section(text, title, section).rstrip("\n") + "\n")
