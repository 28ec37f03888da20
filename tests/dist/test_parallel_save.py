"""sw.save with every rank writing its own regions (``parallel_write``): the same bytes as the
rank-0 stream and as safetensors' save_file, nothing at the target when a rank fails or dies,
and the stream when a rank cannot see the target's filesystem.

Ranks save each model both ways (``parallel_write=False`` streams, ``True`` writes in
parallel and raises rather than fall back); the parent compares the folders byte for byte.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import shardwise as sw
from harness import RankFailure, run_ranks
from hf_shaped import make_lm
from models import make_model, tiny_plan
from shardwise.parallel import get_shard_state, local_of

SMALL = "20KB"  # every model here is over 100 KB: several files


def _files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".shardwise-" in p.name)


def _reference(model, folder: Path, out: Path) -> None:
    """save_file of the tensors sw.save wrote to ``folder`` (one file), from the one-device model."""
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
    state = model.state_dict()
    save_file({n: state[n].clone() for n in names}, out, metadata={"format": "pt"})


# --- what the ranks run ------------------------------------------------------------------------

def _perturb(model, *, replicated_only: bool) -> None:
    """Change this rank's copy: a rank whose copy the save must not write (replicated tensors
    off rank 0, or every tensor of another data-parallel replica) then shows in the bytes."""
    specs = get_shard_state(model).specs
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name in specs and (specs[name].replicated or not replicated_only):
                local_of(t).add_(1)


def _models(backend, degree: int):
    """``{label: parallelised model}``: every tiny-transformer style, a tied MoE LM, and at
    degree 4 expert parallel x tp and two data-parallel replicas of a tp=2 model."""
    out = {"tiny": sw.parallelize(make_model(), tiny_plan(), backend.mesh(tp=degree)),
           "lm": sw.parallelize(make_lm(num_experts=4), "auto", backend.mesh(tp=degree), holding="local")}
    if degree == 4:
        out["lm-ep"] = sw.parallelize(make_lm(num_experts=4), "auto", backend.mesh(ep=2, tp=2))
        out["replicas"] = sw.parallelize(make_model(), tiny_plan("embedding_colwise"),
                                         backend.mesh(dp_replicate=2, tp=2), holding="local")
        if backend.rank >= 2:
            _perturb(out["replicas"], replicated_only=False)
    if backend.rank != 0:
        for model in out.values():
            _perturb(model, replicated_only=True)
    return out


def _both_ways(tmp: Path, degree: int) -> bool:
    backend = sw.init_backend("gloo")
    for label, model in _models(backend, degree).items():
        for how, parallel in (("stream", False), ("parallel", True)):
            sw.save(model, tmp / f"{label}-{how}-one", parallel_write=parallel)
            sw.save(model, tmp / f"{label}-{how}-many", parallel_write=parallel, max_shard_size=SMALL)
    return True


def _failing_rank(tmp: Path) -> dict:
    """Rank 1 fails in the middle of its writes; then rank 1 cannot see rank 0's folder."""
    import shardwise.io.parallel_write as pw
    import shardwise.io.save as ps
    from shardwise.io.storage.local import LocalWriter

    backend = sw.init_backend("gloo")
    model = sw.parallelize(make_model(1), tiny_plan(), backend.mesh(tp=2))
    out = {}
    write, calls = LocalWriter.pwrite, [0]

    def full_disk(self, buf, pos):
        calls[0] += 1
        if calls[0] == 5 and backend.rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return write(self, buf, pos)

    LocalWriter.pwrite = full_disk  # type: ignore[method-assign]
    try:
        sw.save(model, tmp / "ckpt", overwrite=True, max_shard_size=SMALL, parallel_write=True)
    except Exception as e:
        out["disk_full"] = type(e).__name__
    finally:
        LocalWriter.pwrite = write  # type: ignore[method-assign]
    backend.barrier(timeout=20)  # nobody is left in a collective

    real, used = ps.write_parallel, [0]

    def counted(*args, **kwargs):
        used[0] += 1
        return real(*args, **kwargs)

    ps.write_parallel = counted
    sw.save(model, tmp / "one-machine")  # parallel_write=None, one machine: the stream
    out["one_machine_parallel_writes"] = used[0]
    pw.host_id = lambda: f"machine-{backend.rank}"  # as if each rank ran on its own machine
    sw.save(model, tmp / "two-machines")  # None, several machines, a shared folder: parallel
    out["two_machines_parallel_writes"] = used[0]
    # another machine's disk: rank 1 does not see rank 0's temporary folder
    if backend.rank == 1:
        pw._sees_token = lambda path, token: False
    sw.save(model, tmp / "fallback")  # parallel_write=None: probe, then the stream
    out["fallback_parallel_writes"] = used[0] - out["two_machines_parallel_writes"]
    try:
        sw.save(model, tmp / "required", parallel_write=True)
    except Exception as e:
        out["required"] = type(e).__name__
    return out


def _killed(tmp: Path, victim: int) -> None:
    """Rank ``victim`` dies among its writes (rank 0 by SIGKILL, others by _exit)."""
    from shardwise.io.storage.local import LocalWriter

    backend = sw.init_backend("gloo")
    model = sw.parallelize(make_model(1), tiny_plan(), backend.mesh(tp=2))
    write, calls = LocalWriter.pwrite, [0]

    def dying(self, buf, pos):
        calls[0] += 1
        if calls[0] == 4 and backend.rank == victim:
            if victim == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(1)
        return write(self, buf, pos)

    LocalWriter.pwrite = dying  # type: ignore[method-assign]
    sw.save(model, tmp / "ckpt", overwrite=True, max_shard_size=SMALL, parallel_write=True)


# --- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("degree", [2, 4])
def test_parallel_write_is_byte_identical_to_the_stream_and_save_file(tmp_path, degree):
    assert run_ranks(_both_ways, degree, tmp_path, degree, timeout=240) == [True] * degree
    labels = ["tiny", "lm"] + (["lm-ep", "replicas"] if degree == 4 else [])
    models = {"tiny": make_model(), "lm": make_lm(num_experts=4), "lm-ep": make_lm(num_experts=4),
              "replicas": make_model()}
    for label in labels:
        for size in ("one", "many"):
            stream, parallel = tmp_path / f"{label}-stream-{size}", tmp_path / f"{label}-parallel-{size}"
            got = _files(parallel)  # shardwise.json (checksums read back from disk) included
            assert got == _files(stream), (label, size)
            assert ("model.safetensors.index.json" in got) == (size == "many") and "shardwise.json" in got
            report = sw.verify(parallel)
            assert report.ok and report.checksummed == report.tensors > 0, report
        one = tmp_path / f"{label}-parallel-one"
        _reference(models[label], one, tmp_path / f"{label}.safetensors")
        assert (one / "model.safetensors").read_bytes() == (tmp_path / f"{label}.safetensors").read_bytes()
    assert _leftovers(tmp_path) == []


def test_a_failing_rank_leaves_the_previous_checkpoint_and_a_blind_rank_streams(tmp_path):
    target = tmp_path / "ckpt"
    sw.save(make_model(), target, max_shard_size=SMALL)
    before = _files(target)
    results = run_ranks(_failing_rank, 2, tmp_path, timeout=120)
    assert [r["disk_full"] for r in results] == ["CollectiveError", "OSError"]
    assert _files(target) == before
    assert [r["one_machine_parallel_writes"] for r in results] == [0, 0]
    assert [r["two_machines_parallel_writes"] for r in results] == [1, 1]
    assert [r["fallback_parallel_writes"] for r in results] == [0, 0]
    sw.save(make_model(1), tmp_path / "want")
    assert _files(tmp_path / "fallback") == _files(tmp_path / "want")
    assert [r["required"] for r in results] == ["CheckpointError", "CheckpointError"]
    assert not (tmp_path / "required").exists()
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_mid_write_leaves_the_previous_checkpoint(tmp_path, victim):
    target = tmp_path / "ckpt"
    sw.save(make_model(), target, max_shard_size=SMALL)
    before = _files(target)
    with pytest.raises(RankFailure):
        run_ranks(_killed, 2, tmp_path, victim, timeout=60)
    assert _files(target) == before
    assert all(".shardwise-tmp-" in name for name in _leftovers(tmp_path))
    sw.save(make_model(1), target, overwrite=True)  # the next save clears what is left
    assert _leftovers(tmp_path) == []
    sw.save(make_model(1), tmp_path / "want")
    assert _files(target) == _files(tmp_path / "want")


def test_one_process_writes_in_parallel_only_when_asked(tmp_path):
    model = make_model()
    sw.save(model, tmp_path / "stream")  # parallel_write=None: one writer, the stream
    sw.save(model, tmp_path / "parallel", parallel_write=True)
    assert _files(tmp_path / "parallel") == _files(tmp_path / "stream")
    with pytest.raises(sw.UsageError, match="parallel_write"):
        sw.save(model, tmp_path / "bad", parallel_write="yes")
    assert not (tmp_path / "bad").exists() and _leftovers(tmp_path) == []
