"""Where one rank's ``sw.load`` spends its time: a timer on the pipeline's steps, by wrapping the
functions that run them wherever the package refers to them (found by identity, so the same
timer works across refactors that move an import), plus the imports the call triggers.

    with LoadPhases() as phases:
        sw.load(model, folder, plan="auto", mesh=mesh)
    phases.seconds  # {"imports", "plan", "detect", "read", "place", "wire", "other", "total"}
    phases.cpu_seconds  # the same steps (imports aside) in this process's CPU time

- imports: time inside imports of modules not yet imported (``importlib``'s ``_find_and_load``,
  outermost calls only); it is also inside whichever step triggered it.
- plan: ``resolve_for_mesh`` (match the plan, check it).
- detect: ``open_source`` (find the format, list, read headers) and the source's ``match`` and
  ``plan`` (keys, shapes and dtypes against the model; this rank's reads).
- read: the source's ``read`` (bytes into this rank's fresh tensors, each cast as it lands).
- place: ``install`` less ``wire`` (tensors into the model, checked); wire: ``wire`` (forwards).
- other: total less the steps (guards, mesh decoding, moving non-persistent buffers...).
A step that a checkout does not have by that name is reported as ``None``. ``cpu_seconds`` has the
same steps on ``time.process_time`` (this process's CPU, all its threads): what the rank itself
spent, apart from waiting for a core or for the other ranks.
"""

from __future__ import annotations

import functools
import sys
import time

_STEPS = {"plan": ("shardwise.parallel", "resolve_for_mesh"),
          "detect": ("shardwise.io.formats", "open_source"),
          "install": ("shardwise.parallel", "install"), "wire": ("shardwise.parallel", "wire")}

# the pipeline (and what it imports by name), then what a holding imports on first use
_USERS = ("shardwise.io.load", "shardwise.io.place", "shardwise.holding")


def prepare() -> float:
    """Import the loader and what a holding imports on first use (so the timer can wrap what they
    refer to); the seconds it took. Call it before a clock starts: ``sw.load``'s first call would
    import the same."""
    import importlib

    t0 = time.perf_counter()
    for module in _USERS:  # by name, each optional: a checkout without one is timed without it
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    return time.perf_counter() - t0


class LoadPhases:
    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.spent_cpu: dict[str, float] = {}
        self._undo: list = []
        self._start = self._start_cpu = 0.0
        self.seconds: dict[str, float | None] = {}
        self.cpu_seconds: dict[str, float | None] = {}

    def _timed(self, step: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.spent[step] = self.spent.get(step, 0.0) + time.perf_counter() - t0
                self.spent_cpu[step] = self.spent_cpu.get(step, 0.0) + time.process_time() - c0
            if step == "detect" and fn.__name__ == "open_source":
                for method, into in (("match", "detect"), ("plan", "detect"), ("read", "read")):
                    try:  # on the instance, which a source with __slots__ refuses: then untimed
                        setattr(out, method, self._timed(into, getattr(out, method)))
                    except AttributeError:
                        pass
            return out
        return timed

    def _patch(self, owner, name: str, new) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def __enter__(self) -> LoadPhases:
        import importlib

        prepare()

        for step, (module, name) in _STEPS.items():
            original = getattr(importlib.import_module(module), name, None)
            if original is None:
                continue
            wrapped = self._timed(step, original)
            for mod in [m for n, m in sys.modules.items() if n.startswith("shardwise") and m is not None]:
                for attr, value in list(vars(mod).items()):
                    if value is original:
                        self._patch(mod, attr, wrapped)
        bootstrap = sys.modules["importlib._bootstrap"]
        find_and_load, depth = bootstrap._find_and_load, [0]

        def timed_import(*args, **kwargs):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return find_and_load(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    self.spent["imports"] = self.spent.get("imports", 0.0) + time.perf_counter() - t0

        self._patch(bootstrap, "_find_and_load", timed_import)
        self._start, self._start_cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        total, total_cpu = time.perf_counter() - self._start, time.process_time() - self._start_cpu
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)
        self.seconds = {"imports": self.spent.get("imports", 0.0), **_steps(self.spent, total)}
        self.cpu_seconds = _steps(self.spent_cpu, total_cpu)


def _steps(s: dict[str, float], total: float) -> dict[str, float | None]:
    steps = {"plan": s.get("plan"), "detect": s.get("detect"), "read": s.get("read"),
             "place": None if "install" not in s else s["install"] - s.get("wire", 0.0),
             "wire": s.get("wire")}
    return {**steps, "other": total - sum(v for v in steps.values() if v is not None), "total": total}


PHASE_COLUMNS = ("imports", "plan", "detect", "read", "place", "wire", "other")


def breakdown_rows(degree: int, ranks: list[dict], fresh: list[dict] | None) -> list[dict]:
    """One row per rank of a timed load (``ranks``: each with ``phases``, ``construct_s``,
    ``local_bytes``): its steps, and the copy limit measured in the same run: the bytes this rank
    places over the page cache -> fresh memory bandwidth of a rank at this degree (``fresh``:
    that phase's ranks, ``bytes_read`` over ``seconds``); ``of_limit`` = limit / load seconds."""
    bandwidth = (sum(r["bytes_read"] / r["seconds"] for r in fresh) / len(fresh)) if fresh else None
    rows = []
    for r in ranks:
        s = r.get("phases") or {}
        limit = r["local_bytes"] / bandwidth if bandwidth else None
        rows.append({"degree": degree, "rank": r["rank"], "construct": r.get("construct_s"),
                     "loader_import": r.get("loader_import_s"),
                     **{k: s.get(k) for k in (*PHASE_COLUMNS, "total")}, "placed_gb": r["local_bytes"] / 1e9,
                     "fresh_gbps": bandwidth / 1e9 if bandwidth else None, "copy_limit": limit,
                     "of_limit": limit / s["total"] if limit and s.get("total") else None})
    return rows


BREAKDOWN_COLUMNS = [("degree", "tp"), ("rank", "rank"), ("construct", "construct on meta s", ".3f"),
                     ("loader_import", "loader import s", ".3f"),
                     *[(k, f"{k} s", ".3f") for k in PHASE_COLUMNS], ("total", "sw.load s", ".3f"),
                     ("placed_gb", "GB placed", ".3f"), ("fresh_gbps", "fresh-memory GB/s per rank"),
                     ("copy_limit", "copy limit s", ".3f"), ("of_limit", "copy limit ÷ load")]
