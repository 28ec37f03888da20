"""Distributed checkpoints: byte-exact resharding between layouts, canonical on disk,
async == blocking, crash safety and clear errors."""

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise as sw
from harness import run_ranks
from models import fsdp_blocks, make_model, tiny_plan, tokens
from shardwise.core.plan import resolve_plan
from shardwise.core.spec import split
from shardwise.errors import CheckpointError
from shardwise.io.formats.dcp.metadata import read_metadata
from shardwise.parallel import get_shard_state, local_of

# name -> mesh axes on 4 ranks; dp_replicate holds identical copies (written once)
LAYOUTS = {
    "tp1": {"dp_replicate": 4, "tp": 1},
    "tp2": {"dp_replicate": 2, "tp": 2},
    "tp4": {"tp": 4},
    "fsdp2x2": {"dp_shard": 2, "tp": 2},
}


SHARD_SIZE = 40_000  # several files, so the split and the index are compared too


def _model(**kwargs):
    """The tiny transformer (every style, packed included) plus an int64 and a bool buffer."""
    model = make_model(**kwargs)
    model.register_buffer("position_ids", torch.arange(12).reshape(3, 4))
    model.register_buffer("mask", torch.tensor([True, False, True, True]))
    return model


def _meta_model(**kwargs):
    with torch.device("meta"):
        return _model(**kwargs)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _check_shards(model, ref, mesh, layout: str, dtype=None):
    """Every local tensor is exactly its part of the canonical tensor (independent of the
    DCP code: core's split, then torch.chunk for FSDP2's dp shards)."""
    state = get_shard_state(model)
    dp = mesh["dp_shard"] if "dp_shard" in (mesh.mesh_dim_names or ()) else None
    tensors = model.state_dict(keep_vars=True)
    for name, spec in state.specs.items():
        want = split(ref[name], spec, state.degree, state.tp_rank)
        if dtype is not None and want.is_floating_point():
            want = want.to(dtype)
        got = local_of(tensors[name]).detach()
        axes = getattr(getattr(tensors[name], "device_mesh", None), "mesh_dim_names", None) or ()
        if "dp_shard" in axes:
            want = torch.chunk(want, dp.size(), dim=0)[dp.get_local_rank()]
        assert _same_bytes(got, want), (layout, name)


def _matrix(root: str, holding: str):
    backend = sw.init_backend("gloo")
    ref = _model().state_dict()
    meshes = {name: backend.mesh(**axes) for name, axes in LAYOUTS.items()}
    expected_out = _model()(tokens())
    for src, mesh in meshes.items():
        model = _model()
        sw.parallelize(model, tiny_plan(), mesh, holding=holding)
        if src == "fsdp2x2":
            fsdp_blocks(model, mesh)
        sw.save(model, f"{root}/{src}", distributed=True)
        if src == "tp4":
            sw.save(model, f"{root}/gather", max_shard_size=SHARD_SIZE)
    for src in meshes:
        for dst, mesh in meshes.items():
            model = _meta_model()
            sw.load(model, f"{root}/{src}", plan=tiny_plan(), mesh=mesh, holding=holding)
            _check_shards(model, ref, mesh, dst)
            if dst == "fsdp2x2":  # FSDP over the loaded TP shards: same bytes, same forward
                fsdp_blocks(model, mesh)
                _check_shards(model, ref, mesh, dst)
                with torch.no_grad():
                    torch.testing.assert_close(model(tokens()), expected_out, rtol=1e-5, atol=1e-5)
    model = _meta_model()
    sw.load(model, f"{root}/fsdp2x2", plan=tiny_plan(), mesh=meshes["tp2"], holding=holding,
            dtype=torch.bfloat16)
    _check_shards(model, ref, meshes["tp2"], "tp2", dtype=torch.bfloat16)
    return True


@pytest.mark.parametrize("holding", ["dtensor", "local"])
def test_reshard_matrix_is_byte_exact(tmp_path, holding):
    assert run_ranks(_matrix, 4, str(tmp_path), holding, timeout=240) == [True] * 4
    ref = _model().state_dict()
    specs = resolve_plan(_model(), tiny_plan(), 2)
    for layout in LAYOUTS:
        folder = tmp_path / layout
        # plain DCP, one process, no shardwise code: full canonical tensors
        plain = {name: torch.empty_like(t) for name, t in ref.items()}
        dcp.load(plain, checkpoint_id=folder, no_dist=True)
        for name, t in ref.items():
            assert _same_bytes(plain[name], t), (layout, name)
        # every element is stored exactly once (read_metadata checks the chunk volumes): a
        # replicated tensor is one chunk however many ranks hold it, and in the model's order
        md = read_metadata(folder).state_dict_metadata
        assert list(md) == list(ref)
        if layout != "fsdp2x2":
            assert all(len(md[n].chunks) == 1 for n, spec in specs.items() if spec.replicated), layout
        # consolidated from any layout: byte for byte the gather save
        merged = sw.consolidate(folder, tmp_path / f"merged-{layout}", max_shard_size=SHARD_SIZE)
        gathered = {p.name: p.read_bytes() for p in sorted((tmp_path / "gather").iterdir())}
        assert len(gathered) > 2
        assert {p.name: p.read_bytes() for p in sorted(merged.iterdir())} == gathered, layout


def _async_and_failures(root: str):
    import torch.distributed as dist

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(dp_shard=2, tp=2)
    model = _model()
    sw.parallelize(model, tiny_plan(), mesh)
    fsdp_blocks(model, mesh)
    sw.save(model, f"{root}/blocking", distributed=True)
    handle = sw.save(model, f"{root}/async", distributed=True, async_save=True)
    with torch.no_grad():  # the async save staged its copy: changing the model now is safe
        for p in model.parameters():
            local_of(p).add_(1.0)
    handle.wait()
    assert handle.done() and Path(f"{root}/async/.metadata").is_file()

    # a save that fails on one rank leaves the previous checkpoint as it was, and no litter
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data
    if backend.rank == 1:
        def broken(self, plan, planner):
            raise OSError("disk full (injected)")
        FileSystemWriter.write_data = broken
    with pytest.raises(CheckpointError, match="unchanged"):
        sw.save(model, f"{root}/blocking", distributed=True, overwrite=True)
    FileSystemWriter.write_data = write_data
    with pytest.raises(CheckpointError, match="already exists"):
        sw.save(model, f"{root}/blocking", distributed=True)
    dist.barrier()
    assert sorted(p.name for p in Path(root).iterdir()) == ["async", "blocking"]
    dist.barrier()

    # incomplete checkpoints: no .metadata (a save that never finished), a missing data file
    if backend.rank == 0:
        shutil.copytree(f"{root}/blocking", f"{root}/no-metadata")
        Path(f"{root}/no-metadata/.metadata").unlink()
        shutil.copytree(f"{root}/blocking", f"{root}/no-data")
        Path(f"{root}/no-data/__1_0.distcp").unlink()
    dist.barrier()
    tp4 = backend.mesh(tp=4)
    for name in ("no-metadata", "no-data"):
        with pytest.raises(CheckpointError, match="incomplete checkpoint"):
            sw.load(_meta_model(), f"{root}/{name}", plan=tiny_plan(), mesh=tp4)
    # a model of another shape, or with a tensor the checkpoint lacks: named in the error
    with pytest.raises(CheckpointError, match="embed.weight"):
        sw.load(_meta_model(vocab=128), f"{root}/blocking", plan=tiny_plan(), mesh=tp4)
    extra = _meta_model()
    extra.register_buffer("extra_scale", torch.ones(2))
    with pytest.raises(CheckpointError, match="extra_scale"):
        sw.load(extra, f"{root}/blocking", plan=tiny_plan(), mesh=tp4)
    fewer = _meta_model()
    del fewer.mask
    with pytest.raises(CheckpointError, match="'mask'"):
        sw.load(fewer, f"{root}/blocking", plan=tiny_plan(), mesh=tp4)
    _optimizer_reshard(root, backend)
    return True


def _optimizer_reshard(root: str, backend):
    """AdamW state after one step under local holding at tp=4, resumed under DTensor holding
    at tp=2 and saved again: both checkpoints hold the same canonical state."""
    grads = make_model(seed=5).state_dict()
    model = make_model()
    sw.parallelize(model, tiny_plan(), backend.mesh(tp=4), holding="local")
    state = get_shard_state(model)
    for name, p in model.named_parameters():
        p.grad = split(grads[name], state.specs[name], 4, state.tp_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    optimizer.step()
    sw.save_optimizer(model, optimizer, f"{root}/optim-tp4")

    resumed = _meta_model()
    sw.load(resumed, f"{root}/blocking", plan=tiny_plan(), mesh=backend.mesh(dp_replicate=2, tp=2))
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=0.5)
    sw.load_optimizer(resumed, optimizer, f"{root}/optim-tp4")
    assert optimizer.param_groups[0]["lr"] == 0.01 and optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    assert all(float(s["step"]) == 1.0 for s in optimizer.state.values())
    sw.save_optimizer(resumed, optimizer, f"{root}/optim-tp2")


def test_async_save_crash_safety_and_errors(tmp_path):
    assert run_ranks(_async_and_failures, 4, str(tmp_path), timeout=180) == [True] * 4
    ref = _model().state_dict()
    blocking, staged = read_metadata(tmp_path / "blocking"), read_metadata(tmp_path / "async")
    assert blocking.state_dict_metadata == staged.state_dict_metadata
    for folder in ("blocking", "async"):
        plain = {name: torch.empty_like(t) for name, t in ref.items()}
        dcp.load(plain, checkpoint_id=tmp_path / folder, no_dist=True)
        assert all(_same_bytes(plain[n], t) for n, t in ref.items()), folder

    # optimizer state: canonical, keyed by parameter name, the same after tp=4 -> tp=2
    grads = make_model(seed=5).state_dict()
    md = read_metadata(tmp_path / "optim-tp4").state_dict_metadata
    assert md.keys() == read_metadata(tmp_path / "optim-tp2").state_dict_metadata.keys()
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items() if hasattr(m, "size")}
    assert "state.single.0.proj_in.weight.exp_avg" in tensors and "param_groups.head.weight.lr" in md
    loaded = {}
    for folder in ("optim-tp4", "optim-tp2"):
        loaded[folder] = {k: torch.empty_like(t) for k, t in tensors.items()}
        dcp.load(loaded[folder], checkpoint_id=tmp_path / folder, no_dist=True)
    for k, t in loaded["optim-tp4"].items():
        assert _same_bytes(t, loaded["optim-tp2"][k]), k
        if k.endswith(".exp_avg"):  # (1 - beta1) * grad, in the canonical layout
            torch.testing.assert_close(t, 0.2 * grads[k[len("state."):-len(".exp_avg")]])


def test_metadata_unpickler_refuses_code(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="builtins.print"):
        read_metadata(tmp_path)
