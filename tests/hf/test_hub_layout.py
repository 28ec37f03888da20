"""Checkpoints in their hub key layout (what save_pretrained writes), streamed at tp=2.

Mixtral and Qwen3-MoE store one tensor per expert and projection where the module holds
fused 3-D parameters; GPT-NeoX stores ``embed_out`` for ``lm_head``; DeepSeek-V2 mixes MLA
attention, shared and routed experts, and its plan names ``q_b_proj``, which this
configuration lacks (skipped); Qwen3-Next is hybrid (linear attention and full attention);
HRM-Text stores one fused ``gqkv_proj`` (gate|q|k|v) and ``gate_up_proj`` per layer where
the modules are separate, so each stored tensor is assembled from boxes of several model
tensors on save.
``sw.save`` writes the hub layout back, byte-equal to ``save_pretrained``'s files. Each loads
with logits equal to one process, in both holdings, and a rank reads about half of every
expert's bytes where the model's plan splits experts over tp (at tp=2), and exactly its own
experts at ep=2.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402
from hf import hf_models  # noqa: E402

KINDS = ["mixtral", "qwen3_moe", "gpt_neox", "deepseek_v2", "deepseek_v3", "qwen3_next", "hrm_text"]


def _stored_keys(folder) -> dict[str, int]:
    sizes = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open has no __iter__
                sl = h.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                sizes[k] = n * 4  # float32
    return sizes


def _load(kind: str, folder: str, saved: str):
    backend = sw.init_backend("gloo")
    want = hf_models.forward(hf_models.build_tiny(kind), kind)
    out = []
    for holding in ("dtensor", "local"):  # one launch for both holdings: transformers imports are slow
        with sw.empty_model():
            model = hf_models.model_class(kind)._from_config(hf_models.KINDS[kind][2]())
        result = sw.load(model, folder, plan="auto", mesh=backend.mesh(tp=2), holding=holding)
        sw.save(model, f"{saved}-{holding}", max_shard_size=hf_models.SHARD_SIZE)  # the hub layout back
        got = hf_models.forward(model.eval(), kind)
        assert got.shape == want.shape
        assert (got - want).abs().max() < 1e-4, (holding, (got - want).abs().max())
        out.append((result.bytes_read, result.unexpected_keys, result.unused_plan_keys))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_hub_layout_loads_at_tp2_in_both_holdings(tmp_path, kind):
    folder = hf_models.save_tiny(kind, tmp_path / kind)
    stored = _stored_keys(folder)
    model_keys = set(hf_models.build_tiny(kind).state_dict())
    assert set(stored) != model_keys, "the checkpoint should be in its hub layout"
    saved = tmp_path / "saved"
    results = [r for rank in run_ranks(_load, 2, kind, str(folder), str(saved)) for r in rank]
    for holding in ("dtensor", "local"):  # byte for byte what save_pretrained wrote
        out = tmp_path / f"saved-{holding}"
        for f in sorted(folder.iterdir()):
            assert (out / f.name).read_bytes() == f.read_bytes(), (kind, holding, f.name)
    assert all(unexpected == () for _, unexpected, _ in results)
    if kind == "deepseek_v2":  # q_lora_rank=None: no q_b_proj in this configuration
        assert all(any("q_b_proj" in k for k in unused) for _, _, unused in results)
    if kind in ("mixtral", "qwen3_moe"):
        experts = sum(n for k, n in stored.items() if ".experts." in k)
        total = sum(stored.values())
        # the model's own plan decides: transformers 5.25 dropped Mixtral's expert entries from
        # base_model_tp_plan (experts then stay whole on every rank: each rank reads them all)
        tp_plan = hf_models.build_tiny(kind).config.base_model_tp_plan or {}
        if any(".experts." in key for key in tp_plan):  # split over tp: half read per rank
            for bytes_read, _, _ in results:
                assert bytes_read < total - experts / 2 + 1024
                assert bytes_read > experts / 2
        else:  # whole experts, split attention: all of the experts and less than all
            for bytes_read, _, _ in results:
                assert experts <= bytes_read < total


def test_conversion_that_is_not_a_region_map_is_refused(tmp_path):
    # A stored tensor that transformers would transpose cannot be streamed: refuse by name.
    from shardwise.errors import CheckpointError
    from shardwise.hf.hub_layout import _apply
    from shardwise.hf.hub_moves import Virtual

    class Transpose:
        dim0, dim1 = 0, 1

    class Conv:
        source_patterns = ["a"]
        operations = [Transpose()]

    with pytest.raises(CheckpointError, match=r"Conv\(Transpose\).*not a region map"):
        _apply(Conv(), {"a": [Virtual((2, 2), [])]}, "model tensor 'w'")


def _load_ep(kind: str, folder: str, axes: dict):
    backend = sw.init_backend("gloo")
    want = hf_models.forward(hf_models.build_tiny(kind), kind)
    out = []
    for holding in ("dtensor", "local"):
        with sw.empty_model():
            model = hf_models.model_class(kind)._from_config(hf_models.KINDS[kind][2]())
        result = sw.load(model, folder, plan="auto", mesh=backend.mesh(**axes), holding=holding)
        experts = next(m for n, m in model.named_modules() if n.endswith(".mlp.experts"))
        assert experts.num_experts == 4 // axes["ep"]  # transformers' contract for masked routes
        got = hf_models.forward(model.eval(), kind)
        assert (got - want).abs().max() < 1e-4, (holding, (got - want).abs().max())
        out.append(result.bytes_read)
    return out


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "deepseek_v3", "qwen3_next"])
def test_expert_parallel_load_reads_only_own_experts(tmp_path, kind):
    folder = hf_models.save_tiny(kind, tmp_path / kind)
    stored = _stored_keys(folder)
    experts = sum(n for k, n in stored.items() if ".experts." in k and "shared_expert" not in k)
    dense = sum(stored.values()) - experts
    for bytes_read in [b for rank in run_ranks(_load_ep, 2, kind, str(folder), {"ep": 2}) for b in rank]:
        assert bytes_read == dense + experts // 2  # every dense byte, half of the experts'


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "deepseek_v3", "qwen3_next"])
def test_expert_and_tensor_parallel_load(tmp_path, kind):
    folder = hf_models.save_tiny(kind, tmp_path / kind)
    assert len(run_ranks(_load_ep, 4, kind, str(folder), {"ep": 2, "tp": 2}, timeout=240)) == 4


def _dcp_save(kind: str, folder: str, out: str, axes: dict):
    backend = sw.init_backend("gloo")
    with sw.empty_model():
        model = hf_models.model_class(kind)._from_config(hf_models.KINDS[kind][2]())
    sw.load(model, folder, plan="auto", mesh=backend.mesh(**axes))
    sw.save(model, out, distributed=True)  # module names, with the model's config.json beside
    return True


@pytest.mark.parametrize(("kind", "axes"), [("mixtral", {"ep": 2}), ("hrm_text", {"tp": 2})])
def test_consolidate_writes_the_hub_layout(tmp_path, kind, axes):
    folder = hf_models.save_tiny(kind, tmp_path / "ckpt")
    assert run_ranks(_dcp_save, 2, kind, str(folder), str(tmp_path / "dcp"), axes) == [True, True]
    merged = sw.consolidate(tmp_path / "dcp", tmp_path / "merged", max_shard_size=hf_models.SHARD_SIZE)
    for f in sorted(folder.iterdir()):  # save_pretrained's own files, byte for byte
        assert (merged / f.name).read_bytes() == f.read_bytes(), f.name
    module = sw.consolidate(tmp_path / "dcp", tmp_path / "module", layout="module")
    with safe_open(str(module / "model.safetensors"), "pt") as f:  # the module's own names
        own = "model.layers.0.mlp.experts.gate_up_proj" if kind == "mixtral" else \
            "model.H_module.layers.0.self_attn.q_proj.weight"
        assert own in set(f.keys())
