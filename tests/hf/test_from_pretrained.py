"""sw.from_pretrained on real transformers and diffusers models, and sw.save's output read back
by the libraries: logits on 2 gloo ranks equal one process; files byte-equal to save_pretrained."""

from __future__ import annotations

import json

import pytest

from shardwise.parallel import get_shard_state

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

import torch  # noqa: E402
from hf_models import SHARD_SIZE, build_tiny, forward, model_class, save_tiny  # noqa: E402

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402
from shardwise.errors import CheckpointError, UnsupportedModelError  # noqa: E402

TOLERANCE = 1e-4
SAVE_PRETRAINED_LAYOUT = ("llama", "qwen3_tied", "mixtral", "flux2")  # mixtral: per-expert hub layout


def _roundtrip(kind: str, ckpt: str, out: str) -> dict:
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=backend.world_size)
    model = sw.from_pretrained(model_class(kind), ckpt, mesh=mesh)
    state = get_shard_state(model)
    first = forward(model, kind)
    sw.save(model, out, max_shard_size=SHARD_SIZE)
    again = sw.from_pretrained(model_class(kind), out, mesh=mesh)
    # Tensors go back as lists: a tensor sent through the harness queue needs its sender alive.
    return {"first": first.tolist(), "again": forward(again, kind).tolist(), "training": model.training,
            "tensors": model.result.tensors, "sharded": sum(not s.replicated for s in state.specs.values())}


# muse_spark_text: its embedding is an nn.Embedding subclass that normalises after the lookup
@pytest.mark.parametrize("kind", ["llama", "qwen3_tied", "mixtral", "muse_spark_text", "flux2"])
def test_tp2_logits_equal_one_process_and_save_reads_back(tmp_path, kind):
    ckpt = save_tiny(kind, tmp_path / "ckpt")
    reference = forward(build_tiny(kind), kind)
    out = tmp_path / "out"
    rows = run_ranks(_roundtrip, 2, kind, str(ckpt), str(out), timeout=240)
    for rank, row in enumerate(rows):
        assert not row["training"], "from_pretrained returns the model in eval mode"
        assert row["sharded"] > 0 and row["tensors"] > 0
        for what in ("first", "again"):
            diff = (torch.tensor(row[what]) - reference).abs().max().item()
            assert diff <= TOLERANCE, (kind, rank, what, diff)
    # The library itself loads sw.save's output as it is (config.json written beside the weights).
    library = model_class(kind).from_pretrained(out)
    assert (forward(library, kind) - reference).abs().max().item() <= TOLERANCE
    if kind in SAVE_PRETRAINED_LAYOUT:  # every file save_pretrained wrote, byte for byte
        for f in sorted(ckpt.iterdir()):
            assert (out / f.name).read_bytes() == f.read_bytes(), (kind, f.name)
        assert sorted(p.name for p in out.iterdir()) == sorted([*(p.name for p in ckpt.iterdir()),
                                                                "shardwise.json"])


def _load_bf16(kind: str, ckpt: str) -> list:
    backend = sw.init_backend("gloo")
    model = sw.from_pretrained(model_class(kind), ckpt, mesh=backend.mesh(tp=2), dtype=torch.bfloat16)
    return sorted({str(p.dtype) for p in model.parameters()})


def test_dtype_builds_and_casts(tmp_path):
    ckpt = save_tiny("qwen3_tied", tmp_path / "ckpt")
    assert run_ranks(_load_bf16, 2, "qwen3_tied", str(ckpt)) == [["torch.bfloat16"]] * 2


def _load_with_plan(ckpt: str, plan) -> tuple[int, int]:
    backend = sw.init_backend("gloo")
    model = sw.from_pretrained(model_class("llama"), ckpt, mesh=backend.mesh(tp=1), plan=plan)
    specs = get_shard_state(model).specs
    return len(specs), sum(not s.replicated for s in specs.values())


def test_explicit_plan_replaces_the_models_own(tmp_path):
    ckpt = save_tiny("llama", tmp_path / "ckpt")
    auto, = run_ranks(_load_with_plan, 1, str(ckpt), "auto")
    mine, = run_ranks(_load_with_plan, 1, str(ckpt), {"model.layers.*.mlp.down_proj": "rowwise"})
    assert mine == (auto[0], 2)  # the two down projections only
    assert auto[1] > mine[1]


def _bad_path(kind: str, path: str) -> str:
    backend = sw.init_backend("gloo")
    try:
        sw.from_pretrained(model_class(kind), path, mesh=backend.mesh(tp=1))
    except (CheckpointError, UnsupportedModelError) as e:
        return str(e)
    return "no error"


def test_errors_name_the_cause_and_the_fix(tmp_path):
    # not a local folder, so a hub repo id: absent from the hub, or the hub unreachable from here
    assert "no local folder of that name" in run_ranks(_bad_path, 1, "llama", "org/not-a-local-folder")[0]
    assert "no such folder" in run_ranks(_bad_path, 1, "llama", str(tmp_path / "absent"))[0]
    (tmp_path / "empty").mkdir()
    assert "no config.json" in run_ranks(_bad_path, 1, "llama", str(tmp_path / "empty"))[0]
    with pytest.raises(UnsupportedModelError, match="sw.empty_model"):
        sw.from_pretrained(torch.nn.Linear, tmp_path, mesh=None)
    with pytest.raises(TypeError, match="model class"):
        sw.from_pretrained("AutoModelForCausalLM", tmp_path, mesh=None)


def test_index_metadata_like_save_pretrained(tmp_path):
    # total_parameters counts a tied weight once and no buffer, as transformers does.
    ckpt = save_tiny("qwen3_tied", tmp_path / "ckpt")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    model = build_tiny("qwen3_tied")
    assert index["metadata"]["total_parameters"] == model.num_parameters()
    sw.save(model, tmp_path / "out", max_shard_size=SHARD_SIZE)  # one process, no group
    assert (tmp_path / "out" / "model.safetensors.index.json").read_bytes() == \
        (ckpt / "model.safetensors.index.json").read_bytes()
