"""``shardwise demo``: on local gloo ranks, stream the toy model's checkpoint with ``sw.load``
(against loading it whole and sharding), check the forward, then a gather save, a distributed
save and a load of it at ``tp / 2``; per rank bytes read, peak memory and seconds."""

from __future__ import annotations

import ctypes
import gc
import tempfile
import time
from pathlib import Path

import torch

from shardwise.testing import PeakMemory, read_all, spawn, write_checkpoint
from shardwise.testing.model import TP_PLAN, build, config_for, tokens

_TOLERANCE = 1e-4


def _model(size: str, *, seed: int | None = 0, device: str | None = None) -> torch.nn.Module:
    """The toy transformer at ``size``."""
    return build(seed, device=device, config=config_for(size))


def check_degree(size: str, tp: int) -> None:
    """Raise ``ValueError`` unless ``tp`` divides the KV heads of the ``size`` model."""
    heads = config_for(size).kv_heads
    degrees = [d for d in range(1, heads + 1) if heads % d == 0]
    if tp not in degrees:
        raise ValueError(f"{tp!r} does not divide the {heads} KV heads of the {size} model; choose one "
                         f"of {', '.join(map(str, degrees))}")


def _release_freed_memory() -> None:
    """Give freed heap pages back to the system, so that a step's peak counts its own only."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc: nothing to trim, figures are upper bounds
        pass


def _timed(step, backend):
    """``(result, peak bytes, seconds, method)`` of ``step()``, the ranks starting together."""
    gc.collect()
    _release_freed_memory()
    backend.barrier()
    with PeakMemory() as peak:
        t0 = time.perf_counter()
        result = step()
        seconds = time.perf_counter() - t0
    return result, peak.bytes, seconds, peak.method


def _forward_diff(model, size: str, reference: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(tokens(config_for(size))) - reference).abs().max().item()


def _rank(folder: str, files: list[str], size: str, reference: torch.Tensor, out: str) -> dict:
    import safetensors.torch
    import torch.distributed.tensor.parallel  # noqa: F401  (imported before either timing)

    import shardwise as sw

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=backend.world_size)
    row: dict = {"rank": backend.rank}
    # Warm torch's DTensor paths once, untimed, so neither method pays first-call costs.
    sw.parallelize(_model("tiny"), TP_PLAN, mesh)

    model = _model(size, seed=None, device="meta")
    result, peak, seconds, row["rss_method"] = _timed(
        lambda: sw.load(model, folder, plan=TP_PLAN, mesh=mesh, progress=False), backend)
    row["stream"] = (result.bytes_read, peak, seconds)
    row["max_diff"] = _forward_diff(model, size, reference)

    _, peak, seconds, _ = _timed(lambda: sw.save(model, f"{out}/full", progress=False), backend)
    row["save"] = (peak, seconds)
    _, peak, seconds, _ = _timed(lambda: sw.save(model, f"{out}/dcp", distributed=True), backend)
    row["dcp"] = (peak, seconds)
    del model

    # The usual way: every rank loads the whole checkpoint, then shards the model.
    def whole() -> None:
        model = _model(size, seed=None, device="meta")
        for f in files:  # copied out of the mmap, as load_state_dict into a real model would
            part = {k: v.clone() for k, v in safetensors.torch.load_file(f).items()}
            model.load_state_dict(part, strict=False, assign=True)
            del part
        sw.parallelize(model, TP_PLAN, mesh)

    _, peak, seconds, _ = _timed(whole, backend)
    row["whole"] = (sum(Path(f).stat().st_size for f in files), peak, seconds)

    if backend.world_size % 2 == 0:  # the distributed checkpoint at half the degree
        half = backend.mesh(dp_replicate=2, tp=backend.world_size // 2)
        model = _model(size, seed=None, device="meta")
        result, peak, seconds, _ = _timed(
            lambda: sw.load(model, f"{out}/dcp", plan=TP_PLAN, mesh=half, progress=False), backend)
        row["reshard"] = (result.bytes_read, peak, seconds, _forward_diff(model, size, reference))
    return row


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _ratio(baseline: float, ours: float, better: str, worse: str) -> str:
    if baseline <= 0 or ours <= 0:
        return "n/a"
    r = baseline / ours
    if 0.9 < r < 1.1:
        return "about the same"
    return f"{r:.1f}x {better}" if r >= 1 else f"{1 / r:.1f}x {worse}"


_COLUMNS = (("bytes read", 12), ("peak RSS", 12), ("seconds", 9))


def _table(rows: list[dict], groups: list[tuple[str, str, int]], gap: str) -> str:
    """A line per rank; each group ``(title, key, n)`` shows under ``title`` the last ``n`` of
    bytes read, peak RSS and seconds, from the first ``n`` values of ``row[key]``."""
    heads = [f"{title:^{36 if n == 3 else 22}}" for title, _, n in groups]
    names = [" ".join(f"{c:>{w}}" for c, w in _COLUMNS[-n:]) for _, _, n in groups]
    lines = [f"{'':>4}  {gap.join(heads)}", f"{'rank':>4}  {gap.join(names)}"]
    for r in rows:
        cells = [" ".join(f"{v:>9.3f}" if c == "seconds" else f"{_mb(v):>12}"
                          for (c, _), v in zip(_COLUMNS[-n:], r[key][:n], strict=True))
                 for _, key, n in groups]
        lines.append(f"{r['rank']:>4}  {gap.join(cells)}")
    return "\n".join(lines)


def _save_table(rows: list[dict], tp: int) -> str:
    groups = [("--- gather save ---", "save", 2), ("--- distributed save ---", "dcp", 2),
              (f"--- load it at tp={tp // 2} ---", "reshard", 3)]
    return _table(rows, [g for g in groups if g[1] in rows[0]], "  ")


def _memory_words(method: str) -> str:
    if method == "VmHWM":
        how = ("the kernel's record of the most RAM the process held (VmHWM), reset at the start "
               "of each step")
    elif method == "sampled":
        how = "RAM use sampled every 2 ms (a lower bound: a short spike can fall between samples)"
    else:
        how = "not measured on this system (no /proc), so it reads 0"
    return (f"peak RSS: the most RAM each rank's process held during the step, above what it held "
            f"just before; measured from {how}.")


def run_demo(*, tp: int = 4, size: str = "small", keep: str | None = None) -> int:
    """Run the demo on ``tp`` local gloo ranks; return 0 when every forward matched."""
    check_degree(size, tp)
    with tempfile.TemporaryDirectory(prefix="shardwise-demo-") as tmp:
        folder = Path(keep) if keep else Path(tmp) / "ckpt"
        out = Path(keep).with_name(Path(keep).name + "-saved") if keep else Path(tmp) / "saved"
        model = _model(size)
        params = sum(p.numel() for p in model.parameters())
        with torch.no_grad():
            reference = model(tokens(config_for(size)))
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
        third = -(-sum(v.numel() * v.element_size() for v in state.values()) // 3)  # about three files
        files = write_checkpoint(folder, state.items(), shapes, max_shard_size=max(1, third))
        del model, state
        total = sum(f.stat().st_size for f in files)
        print(f"shardwise demo: {size} transformer, {params / 1e6:.1f}M parameters (fp32), "
              f"checkpoint {_mb(total)} in {len(files)} files + index at {folder}"
              f"{'' if keep else ' (temporary)'}")
        print(f"streaming it at degree {tp} on {tp} gloo ranks, then saving it back...\n")
        rows = spawn(_rank, tp, args=(str(folder), [str(f) for f in files], size, reference, str(out)),
                     timeout=600)
        return _report(rows, tp, size, out, keep)


def _report(rows: list[dict], tp: int, size: str, out: Path, keep: str | None) -> int:
    """Print every rank's figures and check what they saved in ``out``; 0 when every check passes."""
    want, got = _model(size).state_dict(), read_all(out / "full")
    same = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    saved = sum(f.stat().st_size for f in (out / "full").glob("*.safetensors"))
    parts = sorted((out / "dcp").glob("*.distcp"))
    print(_table(rows, [("--- shardwise streaming load ---", "stream", 3),
                        ("--- load_file, then shard ---", "whole", 3)], "    "))
    worst = max(r["max_diff"] for r in rows)
    stream_mem, whole_mem = max(r["stream"][1] for r in rows), max(r["whole"][1] for r in rows)
    stream_s, whole_s = max(r["stream"][2] for r in rows), max(r["whole"][2] for r in rows)
    print(f"\n{_memory_words(rows[0]['rss_method'])} load_file maps and copies every tensor of every file.")
    print(f"streaming vs load-then-shard: {_ratio(whole_mem, stream_mem, 'less', 'more')} peak memory "
          f"(largest rank), {_ratio(whole_s, stream_s, 'faster', 'slower')} (slowest rank)")
    print(f"forward check against one process: max |diff| = {worst:.2e} "
          f"(tolerance {_TOLERANCE:g}): {'OK' if worst <= _TOLERANCE else 'FAILED'}\n")
    print(_save_table(rows, tp))
    where = f" at {out}" if keep else ""
    print(f"\ngather save: rank 0 wrote one ordinary safetensors checkpoint ({_mb(saved)}){where}, "
          "one tensor at a time; the other ranks only sent their shards. Same tensors as the "
          f"model: {'OK' if same else 'FAILED'}")
    print(f"distributed save: each of the {tp} ranks wrote its own part, nothing gathered "
          f"({len(parts)} files, {_mb(sum(f.stat().st_size for f in parts))})")
    ok = worst <= _TOLERANCE and same
    if "reshard" in rows[0]:
        diff = max(r["reshard"][3] for r in rows)
        ok = ok and diff <= _TOLERANCE
        print(f"reshard: the tp={tp} distributed checkpoint loaded at tp={tp // 2} (2 replicas); each "
              f"rank read only the chunks its tp={tp // 2} shard needs. Forward check: "
              f"max |diff| = {diff:.2e}: {'OK' if diff <= _TOLERANCE else 'FAILED'}")
    return 0 if ok else 1
