"""Sharded safetensors checkpoints (torch's HuggingFaceStorageWriter(save_distributed=True)
format) in both directions: transformers writes, shardwise reads at other degrees and
consolidates; shardwise writes, torch's HF storage reader, torch's consolidation and
transformers read it at another layout. Real spawned gloo ranks, tiny models."""

import pytest

from shardwise.parallel import get_shard_state

pytest.importorskip("transformers")

from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from hf_models import forward  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files  # noqa: E402
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader  # noqa: E402

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402
from shardwise.core.plan import plan_from_model  # noqa: E402
from shardwise.core.spec import split  # noqa: E402
from shardwise.io.formats.sharded.source import is_sharded_safetensors, read_sharded  # noqa: E402
from shardwise.parallel import local_of  # noqa: E402

KIND = "llama"  # hf_models.forward's input ids (vocab 96)
TIMEOUT = 300


def _config():
    from transformers import LlamaConfig

    # 4 heads and 4 kv heads: loads at tp=1, 2 and 4
    return LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                       tie_word_embeddings=False)


def _build(seed: int = 0):
    """The tiny Llama with seeded weights (norms too, so a misplaced tensor shows)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM._from_config(_config())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _sw_load(folder, mesh, holding="dtensor"):
    """A Llama of other weights filled from ``folder`` by ``sw.load``."""
    model = _build(seed=99)
    sw.load(model, folder, plan="auto", mesh=mesh, holding=holding)
    return model


def _check_local(model, ref: dict):
    """Every local tensor is exactly its part of the reference tensor (core's split)."""
    state = get_shard_state(model)
    tensors = model.state_dict(keep_vars=True)
    for name, spec in state.specs.items():
        want = split(ref[name], spec, state.degree, state.tp_rank)
        assert _same_bytes(local_of(tensors[name]).detach(), want), name


def _logits(model) -> list:
    """The model's logits as nested lists: a tensor a rank returns through the harness' queue
    travels as shared memory that the parent may open only after the rank has exited."""
    return forward(model, KIND).tolist()


def _transformers_load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto").eval()


# --- transformers writes, shardwise reads ---------------------------------------------------

def _hf_writes_tp2(src: str, dst: str):
    backend = sw.init_backend("gloo")
    model = _transformers_load(src)  # tp=2 over the 2 ranks
    assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "DTensor"
    model.save_pretrained(dst, distributed_checkpoint=True)  # ends with a barrier
    loaded = _sw_load(dst, backend.mesh(tp=2))
    _check_local(loaded, _build().state_dict())
    return _logits(loaded)


def _sw_reads_tp4_tp1(dst: str):
    backend = sw.init_backend("gloo")
    ref = _build().state_dict()
    out = []
    for mesh in (backend.mesh(tp=4), backend.mesh(dp_replicate=4, tp=1)):
        model = _sw_load(dst, mesh)
        _check_local(model, ref)
        out.append(_logits(model))
    return out


def test_transformers_writes_shardwise_reads_at_any_degree(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "hf-dcp"
    reference = _build()
    reference.save_pretrained(src)  # one ordinary file: what the weights were
    expected = forward(reference, KIND)
    logits = run_ranks(_hf_writes_tp2, 2, str(src), str(dst), timeout=TIMEOUT)
    names = sorted(p.name for p in dst.glob("*.safetensors"))
    assert names == ["shard-00001-model-00001-of-00001.safetensors",
                     "shard-00002-model-00001-of-00001.safetensors"]
    assert is_sharded_safetensors(dst) and not is_sharded_safetensors(src)
    assert max(len(t.chunks) for t in read_sharded(dst).tensors.values()) == 2
    logits += [x for per_rank in run_ranks(_sw_reads_tp4_tp1, 4, str(dst), timeout=TIMEOUT) for x in per_rank]
    assert len(logits) == 2 + 4 * 2
    for got in logits:
        torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-5, atol=1e-5)
    # consolidated: the very bytes save_pretrained wrote for the unsharded model
    merged = sw.consolidate(dst, tmp_path / "merged")
    assert sorted(p.name for p in merged.glob("*.safetensors*")) == ["model.safetensors"]
    assert (merged / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


# --- shardwise writes, torch and transformers read ------------------------------------------

def _sw_writes_tp2(src: str, dst: str):
    backend = sw.init_backend("gloo")
    model = _build(seed=99)
    sw.load(model, src, plan=plan_from_model(model), mesh=backend.mesh(tp=2))
    sw.save(model, dst, distributed=True, format="safetensors")
    return sorted(p.name for p in Path(dst).iterdir())


def _fsdp_tp_llama_then_transformers_reads_tp4(src: str, dst: str, dst_fsdp: str):
    from torch.distributed.fsdp import fully_shard

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(dp_shard=2, tp=2)
    model = _build(seed=99)
    sw.load(model, src, plan=plan_from_model(model), mesh=mesh)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    sw.save(model, dst_fsdp, distributed=True, format="safetensors")
    ref = _build().state_dict()
    out = []
    for folder in (dst, dst_fsdp):  # written at tp=2 and at FSDP2 x TP 2x2; read at tp=4
        loaded = _transformers_load(folder)
        assert type(loaded.model.layers[0].mlp.down_proj.weight).__name__ == "DTensor"
        for name, t in loaded.state_dict().items():
            full = t.full_tensor() if type(t).__name__ == "DTensor" else t
            assert _same_bytes(full.detach(), ref[name]), (folder, name)
        out.append(_logits(loaded))
    return out


def _torch_reads(folder: Path, ref: dict, merged: Path):
    """torch's HF storage reader (one process, full tensors) and torch's consolidation."""
    full = {name: torch.empty_like(t) for name, t in ref.items()}
    dcp.load(full, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
    for name, t in ref.items():
        assert _same_bytes(full[name], t), name
    merged.mkdir()
    consolidate_safetensors_files(str(folder), str(merged), dict.fromkeys(ref, 1))
    theirs = load_file(merged / "model-00001-of-00001.safetensors")
    assert sorted(theirs) == sorted(ref)
    assert all(_same_bytes(theirs[n], ref[n]) for n in ref)


def test_shardwise_writes_torch_and_transformers_read(tmp_path):
    src, dst, dst_fsdp = tmp_path / "src", tmp_path / "sw-dcp", tmp_path / "sw-dcp-fsdp"
    reference = _build()
    reference.save_pretrained(src)
    ref = reference.state_dict()
    listing = run_ranks(_sw_writes_tp2, 2, str(src), str(dst), timeout=TIMEOUT)[0]
    assert listing == ["config.json", "generation_config.json",
                       "shard-00001-model-00001-of-00001.safetensors",
                       "shard-00002-model-00001-of-00001.safetensors", "shardwise.json"]
    _torch_reads(dst, ref, tmp_path / "torch-merged")
    ours = sw.consolidate(dst, tmp_path / "sw-merged")  # and ours: the original bytes
    assert (ours / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    # transformers at another layout (tp=4): the same tensors and logits
    expected = forward(reference, KIND)
    logits = run_ranks(_fsdp_tp_llama_then_transformers_reads_tp4, 4, str(src), str(dst), str(dst_fsdp),
                       timeout=TIMEOUT)
    for got in [x for per_rank in logits for x in per_rank]:
        torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-5, atol=1e-5)
    assert max(len(t.chunks) for t in read_sharded(dst_fsdp).tensors.values()) == 4
    _torch_reads(dst_fsdp, ref, tmp_path / "torch-merged-fsdp")


# --- FSDP2 x TP with packed weights ------------------------------------------------------------

def _fsdp_tp_writes(root: str):
    from torch.distributed.fsdp import fully_shard

    from models import make_model, tiny_plan, tokens

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(dp_shard=2, tp=2)
    model = make_model()
    with torch.no_grad():
        expected = model(tokens())
    sw.parallelize(model, tiny_plan(), mesh)
    for block in [*model.layers, *model.fused, *model.single]:
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    sw.save(model, f"{root}/fsdp-tp", distributed=True, format="safetensors")
    ref = make_model().state_dict()
    layouts = [({"tp": 4}, "dtensor"), ({"tp": 4}, "local"), ({"dp_replicate": 2, "tp": 2}, "dtensor")]
    for layout, holding in layouts:  # read back at other layouts
        loaded = make_model(seed=7)
        mesh = backend.mesh(**layout)
        sw.load(loaded, f"{root}/fsdp-tp", plan=tiny_plan(), mesh=mesh, holding=holding)
        _check_local(loaded, ref)
        with torch.no_grad():
            torch.testing.assert_close(loaded(tokens()), expected, rtol=1e-5, atol=1e-5)
    return True


def test_fsdp_tp_packed_save_reads_everywhere(tmp_path):
    from models import make_model

    assert run_ranks(_fsdp_tp_writes, 4, str(tmp_path), timeout=TIMEOUT) == [True] * 4
    folder = tmp_path / "fsdp-tp"
    ref = make_model().state_dict()
    ckpt = read_sharded(folder)
    # a packed gate|up under FSDP x TP: several chunks per rank, so several files per rank
    assert max(len(t.chunks) for t in ckpt.tensors.values()) > 4
    assert any("-model-00002-of-" in f.name for f in ckpt.files)
    _torch_reads(folder, ref, tmp_path / "torch-merged")
    ours = load_file(sw.consolidate(folder, tmp_path / "sw-merged") / "model.safetensors")
    assert sorted(ours) == sorted(ref)
    assert all(_same_bytes(ours[n], ref[n]) for n in ref)


# --- an MoE model both ways: transformers writes, shardwise reads (tp and ep); and back ------

def _moe_both_ways(src: str, hf_dst: str, sw_dst: str):
    from hf_models import KINDS, model_class

    backend = sw.init_backend("gloo")
    theirs = _transformers_load(src)  # transformers' own tp=2 load of the Qwen3-MoE
    theirs.save_pretrained(hf_dst, distributed_checkpoint=True)
    out = []
    for axes in ({"tp": 2}, {"ep": 2}):
        with sw.empty_model():
            model = model_class("qwen3_moe")._from_config(KINDS["qwen3_moe"][2]())
        sw.load(model, hf_dst, plan="auto", mesh=backend.mesh(**axes))
        out.append(forward(model.eval(), "qwen3_moe").tolist())
    sw.save(model, sw_dst, distributed=True, format="safetensors")  # written at ep=2
    back = _transformers_load(sw_dst)
    out.append(forward(back, "qwen3_moe").tolist())
    return out


def test_moe_distributed_checkpoint_both_ways(tmp_path):
    from hf_models import build_tiny, save_tiny

    src = save_tiny("qwen3_moe", tmp_path / "src")
    expected = forward(build_tiny("qwen3_moe"), "qwen3_moe")
    results = run_ranks(_moe_both_ways, 2, str(src), str(tmp_path / "hf-dcp"), str(tmp_path / "sw-dcp"),
                        timeout=TIMEOUT)
    for got in [x for per_rank in results for x in per_rank]:
        torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-4, atol=1e-4)
