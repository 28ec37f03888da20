"""sw.load streams each rank's regions straight from safetensors files.

One spawn per layout checks everything at once: the forward equals one process (and equals
``parallelize`` of the same weights, bit for bit), every local shard equals
``split(canonical, spec, degree, rank)`` byte for byte, ``bytes_read`` is exactly the
bytes of the rank's regions, and the dtype cast happened after slicing.
"""

from __future__ import annotations

import io
import json
import math
import sys
import types

import pytest
import safetensors.torch as st
import torch

import shardwise as sw
from harness import run_ranks
from models import TinyTransformer, make_model, tiny_plan, tokens
from shardwise.io.storage import locate
from shardwise.core.header import dtype_to_str
from shardwise.core.spec import shard_regions, split
from shardwise.errors import CheckpointError
from shardwise.io.formats.safetensors.files import StreamingWriter, index_json, plan_files
from shardwise.io.source import ReadMode, Reads
from shardwise.parallel import get_shard_state, local_of


def _canonical(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype).contiguous() for k, v in make_model().state_dict().items()}


def _write_sharded(folder, tensors: dict[str, torch.Tensor], prefix: str, max_size: int):
    folder.mkdir(parents=True, exist_ok=True)
    specs = [(n, dtype_to_str(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    file_plan = plan_files(specs, max_size, prefix=prefix)
    assert len(file_plan) >= 3, "the test wants several files"
    for fname, group in file_plan:
        with StreamingWriter(folder / fname, group) as w:
            for name, _, _ in group:
                w.write(name, tensors[name])
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = folder / f"{prefix}.safetensors.index.json"
    index.write_text(json.dumps(index_json(file_plan, total)))
    return index


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    single = root / "single" / "model.safetensors"
    single.parent.mkdir()
    st.save_file(_canonical(torch.float32), single)
    single_bf16 = root / "single_bf16" / "weights.safetensors"
    single_bf16.parent.mkdir()
    st.save_file(_canonical(torch.bfloat16), single_bf16)
    index = _write_sharded(root / "sharded", _canonical(torch.float32), "model", 40_000)
    _write_sharded(root / "diffusers", _canonical(torch.bfloat16), "diffusion_pytorch_model", 20_000)
    return {
        "file": str(single),                      # a .safetensors file
        "file_bf16": str(single_bf16),
        "index": str(index),                      # the index file itself
        "dir": str(index.parent),                 # a folder with an index
        "diffusers_dir": str(root / "diffusers"),  # another prefix
    }


def _region_bytes(canonical, specs, degree, rank) -> int:
    return sum(math.prod(r.sizes) * canonical[n].element_size()
               for n, spec in specs.items() for r in shard_regions(canonical[n].shape, spec, degree, rank))


def _load_and_check(path, degree, dp, holding, file_dtype, load_dtype, embedding, num_threads):
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=degree) if dp == 1 else backend.mesh(dp_shard=dp, tp=degree)
    rank = mesh["tp"].get_local_rank() if dp > 1 else mesh.get_local_rank()
    plan = tiny_plan(embedding)
    canonical = _canonical(file_dtype)
    out_dtype = load_dtype or file_dtype
    with torch.device("meta"):
        model = TinyTransformer()
    result = sw.load(model, path, plan=plan, mesh=mesh, dtype=load_dtype, holding=holding,
                     num_threads=num_threads, progress=False)
    state = get_shard_state(model)
    assert (state.degree, str(state.holding)) == (degree, holding)

    # every local shard is the split of the canonical tensor, byte for byte, in the load dtype
    tensors = model.state_dict()
    for name, spec in state.specs.items():
        local = local_of(tensors[name])
        is_dtensor = type(tensors[name]).__name__ == "DTensor"
        assert not is_dtensor if holding == "local" else (is_dtensor or spec.replicated), name
        expected = split(canonical[name], spec, degree, rank).to(out_dtype)
        assert local.dtype == out_dtype and local.shape == expected.shape, name
        assert torch.equal(local.view(torch.uint8), expected.view(torch.uint8)), name

    # exactly the bytes of this rank's regions, in the file's dtype: the cast came after slicing
    full = sum(t.numel() * t.element_size() for t in canonical.values())
    assert result.bytes_read == _region_bytes(canonical, state.specs, degree, rank)
    assert (result.bytes_read < full) == (degree > 1)
    assert result.tensors == len(canonical) and not result.missing_keys and not result.unexpected_keys
    assert result.seconds > 0

    # the forward equals parallelize of the same weights bit for bit, and one process closely
    reference = make_model().to(file_dtype).to(out_dtype)
    with torch.no_grad():
        one = reference(tokens())
        sw.parallelize(reference, plan, mesh, holding=holding)
        par = reference(tokens())
        out = model(tokens())
    assert torch.equal(out, par)
    if out_dtype == torch.float32:
        torch.testing.assert_close(out, one, rtol=1e-5, atol=1e-5)
    return result.bytes_read


# degree, dp_shard (ranks = degree x dp_shard), holding, checkpoint, file dtype, load dtype,
# embedding style, threads
LAYOUTS = [
    (1, 1, "dtensor", "file", torch.float32, None, "embedding_rowwise", None),
    (2, 1, "dtensor", "index", torch.float32, None, "embedding_rowwise", 3),
    (2, 1, "local", "file_bf16", torch.bfloat16, torch.float32, "embedding_colwise", 1),
    (4, 1, "dtensor", "diffusers_dir", torch.bfloat16, torch.float32, "embedding_rowwise", 2),
    (4, 1, "local", "dir", torch.float32, torch.bfloat16, "embedding_rowwise", None),
    (2, 2, "local", "dir", torch.float32, None, "embedding_rowwise", 2),  # tp axis of a 2-D mesh
]


def _load_layouts(layouts):
    """Several layouts in one spawn (a spawn costs more than a load of this model)."""
    out = []
    for layout in layouts:
        try:
            out.append(_load_and_check(*layout))
        except Exception as e:
            raise AssertionError(f"layout {layout[1:]} from {layout[0]}: {e!r}") from e
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted({d * p for d, p, *_ in LAYOUTS}))
def test_streaming_load(ckpts, world):
    layouts = [(ckpts[c], d, p, h, *rest) for d, p, h, c, *rest in LAYOUTS if d * p == world]
    got = run_ranks(_load_layouts, world, layouts)
    for i in range(len(layouts)):  # every rank of a layout reads the same number of bytes
        assert len({per_rank[i] for per_rank in got}) == 1


class _FromDcp(Exception):
    """Stops a load at the stand-in DCP source's plan."""


def _errors(folder):
    from pathlib import Path

    folder = Path(folder)
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=1)
    canonical = _canonical(torch.float32)

    def meta_model():
        with torch.device("meta"):
            return TinyTransformer()

    def save(name, tensors):
        path = folder / f"{name}.safetensors"
        st.save_file(tensors, path)
        return path

    # strict: missing keys are listed
    lacking = {k: v for k, v in canonical.items() if k not in ("head.weight", "norm_out.bias")}
    path = save("lacking", lacking)
    with pytest.raises(CheckpointError, match=r"2 model tensor\(s\) missing") as e:
        sw.load(meta_model(), path, plan=tiny_plan(), mesh=mesh)
    assert "head.weight" in str(e.value) and "norm_out.bias" in str(e.value)
    # non-strict on a meta model: it would stay on meta, so it raises naming the tensor
    with pytest.raises(CheckpointError, match=r"meta device\).*head.weight"):
        sw.load(meta_model(), path, plan=tiny_plan(), mesh=mesh, strict=False)
    # non-strict on a materialised model: its own values stay, the keys are reported
    model = make_model(seed=3)
    own_head = model.head.weight.detach().clone()
    result = sw.load(model, path, plan=tiny_plan(), mesh=mesh, strict=False)
    assert sorted(result.missing_keys) == ["head.weight", "norm_out.bias"]
    assert torch.equal(local_of(model.head.weight), own_head)
    assert torch.equal(local_of(model.layers[0].attn.q.weight), canonical["layers.0.attn.q.weight"])

    # a shape that disagrees names the key and both shapes
    wrong = dict(canonical, **{"layers.0.mlp.down.weight": torch.zeros(32, 48)})
    with pytest.raises(CheckpointError, match=r"'layers.0.mlp.down.weight'.*\(32, 48\).*\(32, 64\)"):
        sw.load(meta_model(), save("wrong", wrong), plan=tiny_plan(), mesh=mesh)

    # unexpected keys are reported, the load goes on
    extra = dict(canonical, **{"extra.weight": torch.ones(3), "zzz": torch.ones(1)})
    result = sw.load(meta_model(), save("extra", extra), plan=tiny_plan(), mesh=mesh)
    assert result.unexpected_keys == ("extra.weight", "zzz") and not result.missing_keys

    # a non-persistent buffer left on meta is refused before any read, with the fix
    model = meta_model()
    with torch.device("meta"):
        model.norm_out.register_buffer("table", torch.ones(4), persistent=False)
    with pytest.raises(CheckpointError, match="non-persistent buffer .norm_out.table.*sw.empty_model"):
        sw.load(model, save("plain", canonical), plan=tiny_plan(), mesh=mesh)
    # ... while a materialised one is kept
    model = meta_model()
    model.norm_out.register_buffer("table", torch.arange(4.0), persistent=False)
    sw.load(model, folder / "plain.safetensors", plan=tiny_plan(), mesh=mesh)
    assert torch.equal(model.norm_out.table, torch.arange(4.0))

    # progress: a bar on rank 0 when asked (a stand-in tqdm records it), none when not a terminal
    bars = []

    class FakeBar:
        def __init__(self, total, **kwargs):
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True

    fake = types.ModuleType("tqdm.auto")
    fake.tqdm = FakeBar
    sys.modules.update({"tqdm": types.ModuleType("tqdm"), "tqdm.auto": fake})
    result = sw.load(meta_model(), folder / "plain.safetensors", plan=tiny_plan(), mesh=mesh, progress=True)
    assert len(bars) == 1 and bars[0].n == bars[0].total == result.bytes_read > 0 and bars[0].closed
    stderr, sys.stderr = sys.stderr, io.StringIO()  # not a terminal: no bar unless asked
    try:
        sw.load(meta_model(), folder / "plain.safetensors", plan=tiny_plan(), mesh=mesh)
    finally:
        sys.stderr = stderr
    sw.load(meta_model(), folder / "plain.safetensors", plan=tiny_plan(), mesh=mesh, progress=False)
    assert len(bars) == 1

    # a torch DCP folder (it has .metadata) is read by shardwise.io.formats.dcp.checkpoint's DcpSource with the resolved plan
    calls = []

    class FakeDcpSource:
        def __init__(self, path):
            calls.append(path)

        def match(self, model, specs, *, strict):
            calls.append((specs, strict))
            return [], []

        def plan(self, wants):
            calls.append(wants)
            return Reads(wants, 0)

        def read(self, reads, *, finalize, options, on_bytes=None):
            calls.append(options)
            raise _FromDcp

    fake_dcp = types.ModuleType("shardwise.io.formats.dcp.checkpoint")
    fake_dcp.DcpSource = FakeDcpSource
    sys.modules["shardwise.io.formats.dcp.checkpoint"] = fake_dcp
    dcp_dir = folder / "dcp"
    dcp_dir.mkdir()
    (dcp_dir / ".metadata").write_bytes(b"")
    with pytest.raises(_FromDcp):
        sw.load(meta_model(), dcp_dir, plan=tiny_plan(), mesh=mesh, dtype=torch.bfloat16)
    path, (specs, strict), wants, options = calls
    assert path == locate(dcp_dir) and specs["head.weight"] == sw.ShardSpec(dim=0) and strict is True
    # a tp-only mesh: no dp replicas to share the reads with (tests/dist/test_replicas.py has them)
    assert options.mode is ReadMode.OWN and options.dtype == torch.bfloat16
    # holding "dtensor": this rank's own part of each tensor, on its tp coordinates
    assert wants["head.weight"].spec == sw.ShardSpec(dim=0) and wants["head.weight"].degree == mesh.size()

    # tied weights: stored under either name
    weights = {"embed.weight": torch.randn(8, 4)}
    for name in ("embed.weight", "head.weight"):
        with torch.device("meta"):
            model = _Tied()
        model.head.weight = model.embed.weight
        result = sw.load(model, save(f"tied_{name}", {name: weights["embed.weight"]}), plan={}, mesh=mesh)
        assert model.head.weight is model.embed.weight and not result.missing_keys
        assert torch.equal(model.head.weight.detach(), weights["embed.weight"])

    # an already parallelised model is refused
    with pytest.raises(sw.PlanError, match="already parallelised"):
        sw.load(model, folder / "plain.safetensors", plan={}, mesh=mesh)
    return True


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)


def test_key_and_shape_errors(tmp_path):
    assert run_ranks(_errors, 1, str(tmp_path)) == [True]
