"""``shardwise demo``: stream a sharded safetensors checkpoint on local gloo ranks.

The parent builds a small transformer, writes it as a sharded checkpoint (several files and
an index) and computes the one-process forward. ``tp`` ranks then each stream their slice
with ``sw.load`` into a meta model, check the forward, and, for comparison, do what users do
today: load the whole checkpoint with ``safetensors.torch.load_file`` and shard it. The
table shows, per rank, bytes read, peak memory above the rank's starting level and seconds.
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from shardwise._demo_model import PLAN, build, config_for, demo_tokens
from shardwise.launch import spawn

_TOLERANCE = 1e-4


def write_checkpoint(model: torch.nn.Module, folder: Path, *, num_files: int = 3) -> list[Path]:
    """Write ``model`` as ``model-0000i-of-0000N.safetensors`` files plus the index; return the files."""
    from shardwise.core.header import dtype_to_str
    from shardwise.io.safetensors_io import INDEX_SUFFIX, StreamingWriter, index_json, plan_files

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    specs = [(k, dtype_to_str(v.dtype), tuple(v.shape)) for k, v in state.items()]
    total = sum(v.numel() * v.element_size() for v in state.values())
    file_plan = plan_files(specs, max(1, -(-total // num_files)), prefix="model")
    folder.mkdir(parents=True, exist_ok=True)
    for fname, group in file_plan:
        with StreamingWriter(folder / fname, group) as writer:
            for name, _, _ in group:
                writer.write(name, state[name])
    (folder / f"model{INDEX_SUFFIX}").write_text(json.dumps(index_json(file_plan, total), indent=2))
    return [folder / fname for fname, _ in file_plan]


def _rank(folder: str, files: list[str], size: str, reference: torch.Tensor) -> dict:
    import safetensors.torch
    import torch.distributed.tensor.parallel  # noqa: F401  (imported before either timing)

    import shardwise as sw
    from shardwise._memory import PeakMemory

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=backend.world_size)
    row = {"rank": backend.rank}
    # Warm torch's DTensor paths once, untimed, so neither method pays first-call costs.
    sw.parallelize(build("tiny", seed=0), PLAN, mesh)

    model = build(size, seed=None, device="meta")
    gc.collect()
    backend.barrier()  # the ranks time each method together, not overlapping the other
    with PeakMemory() as peak:
        result = sw.load(model, folder, plan=PLAN, mesh=mesh, progress=False)
    row["stream"] = (result.bytes_read, peak.bytes, result.seconds)
    with torch.no_grad():
        out = model(demo_tokens(size))
    row["max_diff"] = (out - reference).abs().max().item()
    del model, out
    gc.collect()

    # The usual way: every rank loads the whole checkpoint, then shards the model.
    model = build(size, seed=None, device="meta")
    backend.barrier()
    with PeakMemory() as peak:
        t0 = time.perf_counter()
        for f in files:  # copied out of the mmap, as load_state_dict into a real model would
            part = {k: v.clone() for k, v in safetensors.torch.load_file(f).items()}
            model.load_state_dict(part, strict=False, assign=True)
            del part
        sw.parallelize(model, PLAN, mesh)
        seconds = time.perf_counter() - t0
    row["whole"] = (sum(Path(f).stat().st_size for f in files), peak.bytes, seconds)
    row["rss_method"] = peak.method
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


def _table(rows: list[dict]) -> str:
    head = (f"{'':>4}  {'--- shardwise streaming load ---':^36}    {'--- load_file, then shard ---':^36}\n"
            f"{'rank':>4}  {'bytes read':>12} {'peak RSS':>12} {'seconds':>9}    "
            f"{'bytes read':>12} {'peak RSS':>12} {'seconds':>9}")
    lines = [head]
    for r in rows:
        (sb, sp, ss), (wb, wp, ws) = r["stream"], r["whole"]
        lines.append(f"{r['rank']:>4}  {_mb(sb):>12} {_mb(sp):>12} {ss:>9.3f}    "
                     f"{_mb(wb):>12} {_mb(wp):>12} {ws:>9.3f}")
    return "\n".join(lines)


def run_demo(*, tp: int = 4, size: str = "small", keep: str | None = None) -> int:
    """Run the demo on ``tp`` local gloo ranks; return 0 when every rank's forward matched."""
    cfg = config_for(size)
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp must be a positive int, got {tp!r}")
    if cfg.heads % tp:
        raise ValueError(f"--tp {tp} must divide the {cfg.heads} attention heads of the {size} model")
    with tempfile.TemporaryDirectory(prefix="shardwise-demo-") as tmp:
        folder = Path(keep) if keep else Path(tmp)
        model = build(size)
        params = sum(p.numel() for p in model.parameters())
        with torch.no_grad():
            reference = model(demo_tokens(size))
        files = write_checkpoint(model, folder)
        del model
        total = sum(f.stat().st_size for f in files)
        print(f"shardwise demo: {size} transformer, {params / 1e6:.1f}M parameters (fp32), "
              f"checkpoint {_mb(total)} in {len(files)} files + index at {folder}"
              f"{'' if keep else ' (temporary)'}")
        print(f"streaming it at degree {tp} on {tp} gloo ranks...\n")
        rows = spawn(_rank, tp, args=(str(folder), [str(f) for f in files], size, reference), timeout=300)

    print(_table(rows))
    worst = max(r["max_diff"] for r in rows)
    ok = worst <= _TOLERANCE
    stream_mem = max(r["stream"][1] for r in rows)
    whole_mem = max(r["whole"][1] for r in rows)
    stream_s = max(r["stream"][2] for r in rows)
    whole_s = max(r["whole"][2] for r in rows)
    print(f"\npeak RSS is above each rank's level before the load ({rows[0]['rss_method']}); "
          "load_file maps and copies every tensor of every file.")
    print(f"streaming vs load-then-shard: {_ratio(whole_mem, stream_mem, 'less', 'more')} peak memory "
          f"(largest rank), {_ratio(whole_s, stream_s, 'faster', 'slower')} (slowest rank)")
    print(f"forward check against one process: max |diff| = {worst:.2e} "
          f"(tolerance {_TOLERANCE:g}): {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1
