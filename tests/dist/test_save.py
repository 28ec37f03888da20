"""sw.save: gathered checkpoints equal the one they came from, byte for byte; failures leave
the target absent or untouched and never leave a rank waiting.

The original checkpoint is ``save_file(make_model().state_dict())``. Ranks build their models
from it (``parallelize`` after ``load_state_dict``, and ``sw.load`` into a meta model), save,
and return; the parent checks the files.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import shardwise as sw
from harness import RankFailure, run_ranks
from models import TinyTransformer, make_model, tiny_plan
from shardwise.io.storage import locate
from shardwise.io.formats.safetensors.checkpoint import resolve_checkpoint
from shardwise.io.formats.safetensors.files import StreamingWriter

HOLDINGS = ("dtensor", "local")
SMALL = "20KB"  # the tiny model is 160 KB: several files


def _original(folder: Path, seed: int = 0) -> Path:
    path = folder / f"original-{seed}.safetensors"
    save_file(make_model(seed).state_dict(), path, metadata={"format": "pt"})
    return path


def _files(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (relative name -> digest)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".shardwise-" in p.name)


def _assert_same(folder: Path, original: Path, prefix: str = "model") -> None:
    """Every tensor of ``original`` is in ``folder`` with equal values and bytes."""
    ref = load_file(original)
    names = sorted(p.name for p in folder.iterdir())
    assert "shardwise.json" in names  # the per-tensor checksums that sw.verify checks
    names.remove("shardwise.json")
    index = folder / f"{prefix}.safetensors.index.json"
    if index.exists():
        content = json.loads(index.read_text())
        files = sorted(set(content["weight_map"].values()))
        assert names == sorted(files + [index.name])
        assert set(content["weight_map"]) == set(ref)
        assert content["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ref.values())
        assert len(files) > 1
        resolve_checkpoint(folder)  # headers and index pass shardwise's own validation
    else:
        files = [f"{prefix}.safetensors"]
        assert names == files
        # one file: byte-identical to save_file's, header included
        assert (folder / files[0]).read_bytes() == original.read_bytes()
    got = {}
    for fname in files:
        with safe_open(folder / fname, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            opened = {name: f.get_tensor(name) for name in f.keys()}
        loaded = load_file(folder / fname)
        assert set(loaded) == set(opened) and not set(opened) & set(got)
        assert all(torch.equal(loaded[n], opened[n]) for n in opened)
        got.update(loaded)
    assert set(got) == set(ref)
    for name, want in ref.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name], want), name
        assert got[name].contiguous().view(torch.uint8).numpy().tobytes() == \
            want.contiguous().view(torch.uint8).numpy().tobytes(), name


# --- what the ranks run ------------------------------------------------------------------------

def _parallel_model(original: Path, mesh, holding: str, embedding: str = "embedding_rowwise"):
    model = TinyTransformer()
    model.load_state_dict(load_file(original))
    return sw.parallelize(model, tiny_plan(embedding), mesh, holding=holding)


def _loaded_model(original: Path, mesh, holding: str):
    with torch.device("meta"):
        model = TinyTransformer()
    sw.load(model, original, plan=tiny_plan("embedding_colwise"), mesh=mesh, holding=holding)
    return model


def _round_trip(tmp: Path, degree: int) -> bool:
    import shardwise.io.gather as gather

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=degree)
    original = tmp / "original-0.safetensors"
    for holding in HOLDINGS:
        sw.save(_parallel_model(original, mesh, holding), tmp / f"parallelize-{holding}")
        # large tensors are gathered in row chunks: make every tiny one take that path too
        limits = gather._SMALL_BYTES, gather._CHUNK_BYTES
        gather._SMALL_BYTES, gather._CHUNK_BYTES = 64, 1000
        try:
            sw.save(_loaded_model(original, mesh, holding), tmp / f"load-{holding}")
        finally:
            gather._SMALL_BYTES, gather._CHUNK_BYTES = limits
    if degree == 4:  # replicas of a tp=2 model: only the tp group of rank 0 gathers
        mesh2 = backend.mesh(dp_replicate=2, tp=2)
        sw.save(_parallel_model(original, mesh2, "dtensor"), tmp / "replicas")
        # FSDP over tp: not gathered yet; refused on every rank before any collective
        from torch.distributed.fsdp import fully_shard

        mesh3 = backend.mesh(dp_shard=2, tp=2)
        model = _parallel_model(original, mesh3, "dtensor")
        fully_shard(model, mesh=mesh3["dp_shard"])
        with pytest.raises(sw.errors.UnsupportedModelError, match="distributed=True"):
            sw.save(model, tmp / "fsdp")
    return True


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as e:
        return type(e).__name__
    return "ok"


def _options_and_failures(tmp: Path) -> dict:
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=2)
    original = tmp / "original-0.safetensors"
    _round_trip(tmp, 2)
    model = _parallel_model(original, mesh, "local")
    sw.save(model, tmp / "multi", max_shard_size=SMALL, filename_prefix="diffusion_pytorch_model")
    out = {"exists": _outcome(lambda: sw.save(model, tmp / "multi"))}
    other = _parallel_model(tmp / "original-1.safetensors", mesh, "dtensor")
    sw.save(other, tmp / "multi", overwrite=True, max_shard_size=SMALL)  # now seed 1, prefix "model"
    # a model that is not parallelised, identical on both ranks: rank 0 writes it as it is
    sw.save(make_model(), tmp / "plain")
    # ranks holding different models: every rank refuses before any tensor moves
    mixed = make_model() if backend.rank == 0 else make_model().double()
    out["mixed"] = _outcome(lambda: sw.save(mixed, tmp / "mixed"))
    # torch's own tensor parallelism: no shard specs, so refused before any collective
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    foreign = parallelize_module(nn.Linear(4, 4), mesh, ColwiseParallel())
    out["foreign"] = _outcome(lambda: sw.save(foreign, tmp / "foreign"))
    # rank 0's disk fills up in the middle of a file: every rank raises, nothing is left
    calls = [0]
    write = StreamingWriter.write

    def full_disk(self, name, tensor):
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return write(self, name, tensor)

    if backend.rank == 0:
        StreamingWriter.write = full_disk
    try:
        out["disk_full"] = _outcome(lambda: sw.save(model, tmp / "full-disk", parallel_write=False))  # one file
    finally:
        StreamingWriter.write = write
    out["after"] = _outcome(lambda: backend.barrier(timeout=20))  # nobody is stuck in a gather
    return out


def _killed(tmp: Path, victim: int) -> None:
    """Rank ``victim`` dies in the middle of a save (rank 0 by SIGKILL, others by _exit)."""
    backend = sw.init_backend("gloo")
    model = _parallel_model(tmp / "original-1.safetensors", backend.mesh(tp=2), "dtensor")
    import shardwise.io.gather as gather

    real, calls = gather.gather_to_rank0, [0]

    def dying(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 6 and backend.rank == victim:
            if victim == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(1)
        return real(*args, **kwargs)

    gather.gather_to_rank0 = dying
    sw.save(model, tmp / "ckpt", overwrite=True, max_shard_size=SMALL, parallel_write=False)


# --- tests -------------------------------------------------------------------------------------

def _check_round_trip(tmp: Path) -> None:
    for holding in HOLDINGS:
        _assert_same(tmp / f"parallelize-{holding}", tmp / "original-0.safetensors")
        _assert_same(tmp / f"load-{holding}", tmp / "original-0.safetensors")
    assert _leftovers(tmp) == []


@pytest.mark.parametrize("degree", [1, 4])
def test_round_trip_every_style(tmp_path, degree):
    _original(tmp_path)
    assert run_ranks(_round_trip, degree, tmp_path, degree) == [True] * degree
    _check_round_trip(tmp_path)
    if degree == 4:
        _assert_same(tmp_path / "replicas", tmp_path / "original-0.safetensors")
        assert not (tmp_path / "fsdp").exists()


def test_degree_two_round_trip_options_and_failures(tmp_path):
    _original(tmp_path)
    _original(tmp_path, seed=1)
    results = run_ranks(_options_and_failures, 2, tmp_path)
    _check_round_trip(tmp_path)
    assert results[0]["exists"] == results[1]["exists"] == "CheckpointError"
    _assert_same(tmp_path / "multi", tmp_path / "original-1.safetensors")  # replaced by overwrite=True
    _assert_same(tmp_path / "plain", tmp_path / "original-0.safetensors")
    assert results[0]["foreign"] == results[1]["foreign"] == "UnsupportedModelError"
    assert results[0]["mixed"] == results[1]["mixed"] == "CheckpointError"
    assert not (tmp_path / "mixed").exists()
    assert [r["disk_full"] for r in results] == ["OSError", "CollectiveError"]
    assert [r["after"] for r in results] == ["ok", "ok"]
    assert not (tmp_path / "full-disk").exists()
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("victim", [0, 1])
def test_rank_killed_mid_save(tmp_path, victim):
    original = _original(tmp_path)
    _original(tmp_path, seed=1)
    target = tmp_path / "ckpt"
    if victim == 0:  # a previous checkpoint at the path must survive byte for byte
        sw.save(make_model(), target, max_shard_size=SMALL)
        before = _files(target)
    with pytest.raises(RankFailure):
        run_ranks(_killed, 2, tmp_path, victim, timeout=60)
    if victim == 0:
        assert _files(target) == before
        stale = _leftovers(tmp_path)  # rank 0 died: its temporary folder is still there...
        assert len(stale) == 1 and stale[0].startswith(".ckpt.shardwise-tmp-")
        assert not any(p.name.endswith(".index.json") for p in (tmp_path / stale[0]).iterdir())
        assert resolve_checkpoint(target).root == locate(target)  # ...and is not what a loader finds
    else:  # rank 0 saw its peer die, removed its temporary folder and raised
        assert not target.exists()
        assert _leftovers(tmp_path) == []
    sw.save(make_model(), target, overwrite=True)  # the next save clears what is left
    assert _leftovers(tmp_path) == []
    _assert_same(target, original)


def test_world_of_one_is_a_plain_streaming_saver(tmp_path):
    original = _original(tmp_path)
    sw.save(make_model(), tmp_path / "out")
    assert not dist.is_initialized()
    _assert_same(tmp_path / "out", original)
    (tmp_path / "empty").mkdir()  # an empty folder counts as absent
    sw.save(make_model(), tmp_path / "empty", max_shard_size=SMALL, metadata={"who": "test"})
    index = json.loads((tmp_path / "empty" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["who"] == "test"
    first = sorted(set(index["weight_map"].values()))[0]
    with safe_open(tmp_path / "empty" / first, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "who": "test"}
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "tokenizer.json").write_text("{}")  # config.json is part of a checkpoint
    with pytest.raises(sw.CheckpointError, match="tokenizer.json"):
        sw.save(make_model(), tmp_path / "mixed", overwrite=True)  # never deletes foreign files
    assert (tmp_path / "mixed" / "tokenizer.json").exists()
    assert _leftovers(tmp_path) == []


def test_without_atomic_exchange_an_interrupted_swap_is_repaired(tmp_path, monkeypatch):
    import shardwise.io.storage.transaction as target_module
    from shardwise.io.storage.lookups import OLD_MARK, host

    monkeypatch.setattr(target_module, "_renameat2_fn", lambda: None)  # as on macOS
    original, other = _original(tmp_path), _original(tmp_path, seed=1)
    target = tmp_path / "out"
    sw.save(make_model(1), target)
    sw.save(make_model(), target, overwrite=True, max_shard_size=SMALL)
    _assert_same(target, original)
    # killed between "previous checkpoint renamed aside" and "new one renamed in"
    aside = tmp_path / f".out{OLD_MARK}{host()}-999999999-abcd"
    target.rename(aside)
    with pytest.raises(sw.CheckpointError, match="already exists"):
        sw.save(make_model(1), target)  # puts the previous checkpoint back, then refuses
    _assert_same(target, original)
    sw.save(make_model(1), target, overwrite=True)
    _assert_same(target, other)
    assert _leftovers(tmp_path) == []


class _Dtypes(nn.Module):
    """One tensor of each of several dtypes, names out of dtype order."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(3, 5, generator=g, dtype=torch.bfloat16))
        self.b = nn.Parameter(torch.randn(4, generator=g, dtype=torch.float64))
        self.register_buffer("c", torch.arange(6).reshape(2, 3))
        self.register_buffer("d", torch.tensor([True, False, True]))
        self.register_buffer("e", torch.randn(2, 2, generator=g).half())
        self.register_buffer("f", torch.arange(5, dtype=torch.uint8))
        self.z = nn.Parameter(torch.randn(2, generator=g))


def test_one_file_is_byte_identical_to_save_file_for_every_dtype(tmp_path, capsys):
    model = _Dtypes()
    save_file(model.state_dict(), tmp_path / "ref.safetensors", metadata={"format": "pt"})
    sw.save(model, tmp_path / "out", progress=True)
    ref = (tmp_path / "ref.safetensors").read_bytes()
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == ref
    assert "shardwise save" in capsys.readouterr().err  # tqdm's bar, or a line per file without it


class _NoCollectives:
    rank, world_size = 0, 2

    def __getattr__(self, name):
        raise AssertionError(f"collective {name} called before the guard")


def test_quantized_tensor_parallel_model_is_refused_before_any_collective(tmp_path, monkeypatch):
    from shardwise.core.plan import resolve_plan
    from shardwise.parallel import ShardState

    model = make_model()
    proj = model.layers[0].attn.q
    proj.weight = nn.Parameter(torch.zeros(32, 32, dtype=torch.int8), requires_grad=False)
    proj.register_buffer("weight_scale", torch.ones(32))
    specs = resolve_plan(model, tiny_plan(), 2)
    model.__dict__["_shardwise_state"] = ShardState(mesh=None, tp_mesh=None, degree=2, tp_rank=0,
                                                    holding="local", specs=specs)
    import shardwise.io.save as save_module

    monkeypatch.setattr(save_module, "world_backend", lambda: _NoCollectives())
    with pytest.raises(sw.errors.UnsupportedModelError, match="layers.0.attn.q.weight"):
        sw.save(model, tmp_path / "q")
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments_raise_before_any_collective(tmp_path, monkeypatch):
    import shardwise.io.save as save_module

    monkeypatch.setattr(save_module, "world_backend", lambda: _NoCollectives())
    model = make_model()
    for kwargs, error in [({"max_shard_size": "5 gigs"}, sw.CheckpointError),
                          ({"filename_prefix": "a/b"}, sw.CheckpointError),
                          ({"metadata": {"format": "np"}}, sw.CheckpointError),
                          ({"metadata": {"n": 1}}, sw.CheckpointError),
                          ({"async_save": True}, ValueError)]:
        with pytest.raises(error):
            sw.save(model, tmp_path / "x", **kwargs)
    with pytest.raises(sw.CheckpointError, match="must name a folder"):
        sw.save(model, "/")
    assert list(tmp_path.iterdir()) == []
