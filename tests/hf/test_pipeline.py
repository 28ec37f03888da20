"""sw.from_pretrained on whole diffusers pipelines (Flux2 with Mistral3, QwenImage with Qwen2.5-VL,
Wan with UMT5 under shardwise's plan) on gloo ranks: the image equals the one-process pipeline's,
each sharded component reads its slices only, sw.save writes a folder diffusers loads whose files
are byte-equal to the source."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

import torch  # noqa: E402
from pipeline_models import SHARDED_IN, build_pipeline, generate, pipeline_class, save_pipeline  # noqa: E402

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402
from shardwise.errors import CheckpointError, ShardingError, UnsupportedModelError, UsageError  # noqa: E402
from shardwise.mesh import get_shard_state  # noqa: E402

TOLERANCE = 1e-4
SHARD_SIZE = "60KB"  # as save_pipeline wrote the source, so the files compare byte for byte


def _sharded(model: torch.nn.Module) -> bool:
    state = get_shard_state(model)
    return state is not None and any(not s.replicated for s in state.specs.values())


def _local_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of this rank's local tensors, bytes of the whole model), float32 throughout."""
    local = whole = 0
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}  # a tied weight once
    for t in unique.values():
        whole += t.numel() * t.element_size()
        held = t.to_local() if type(t).__name__ == "DTensor" else t
        local += held.numel() * held.element_size()
    return local, whole


def _run(family: str, ckpt: str, out: str | None) -> dict:
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=backend.world_size)
    pipe = sw.from_pretrained(pipeline_class(family), ckpt, mesh=mesh)
    if out is not None:  # before the pipeline runs: a call with padding= records it in tokenizer.json
        sw.save(pipe, out, max_shard_size=SHARD_SIZE)
    row: dict = {"image": generate(pipe, family).tolist(), "read": {}, "sharded": {}}
    for name in SHARDED_IN[family]:
        model = getattr(pipe, name)
        row["read"][name] = (pipe.result[name].bytes_read, *_local_bytes(model))
        row["sharded"][name] = sum(not s.replicated for s in get_shard_state(model).specs.values())
    whole = [n for n in ("transformer", "vae") if n not in SHARDED_IN[family]]  # Wan's transformer: no plan
    row["whole"] = [not _sharded(getattr(pipe, n)) and get_shard_state(getattr(pipe, n)) is not None
                    and not getattr(pipe, n).training for n in whole]
    return row


@pytest.mark.parametrize("family,tp", [("flux2", 2), ("flux2", 4), ("qwenimage", 2), ("qwenimage", 4),
                                       ("wan", 2), ("wan", 4)])
def test_image_equals_one_process_and_save_is_byte_equal(tmp_path, family, tp):
    ckpt = save_pipeline(family, tmp_path / "pipe", max_shard_size=SHARD_SIZE)
    reference = generate(build_pipeline(family), family)
    out = tmp_path / "out"
    rows = run_ranks(_run, tp, family, str(ckpt), str(out) if tp == 2 else None, timeout=600)
    for rank, row in enumerate(rows):
        diff = (torch.tensor(row["image"]) - reference).abs().max().item()
        assert diff <= TOLERANCE, (family, tp, rank, diff)
        assert row["whole"] and all(row["whole"]), "the VAE (Wan: and the transformer) whole, in eval mode"
        for name in SHARDED_IN[family]:
            read, local, whole = row["read"][name]
            assert row["sharded"][name] > 0, name
            # each rank reads exactly its own slices: the sharded tensors' 1/tp and the rest whole
            assert read == local < whole, (family, tp, rank, name, read, local, whole)
    if tp != 2:
        return
    from diffusers import DiffusionPipeline

    for sub in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        assert (out / sub.relative_to(ckpt)).read_bytes() == sub.read_bytes(), sub.relative_to(ckpt)
    extra = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - \
        {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()}
    assert all(p.endswith("shardwise.json") for p in extra), extra  # each model's checksums
    again = DiffusionPipeline.from_pretrained(out)
    assert (generate(again, family) - reference).abs().max().item() <= TOLERANCE


def _choices(ckpt: str) -> dict:
    from diffusers import DiffusionPipeline, Flux2Transformer2DModel

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=2)
    transformer = sw.from_pretrained(Flux2Transformer2DModel, f"{ckpt}/transformer", mesh=mesh)
    pipe = sw.from_pretrained(DiffusionPipeline, ckpt, mesh=mesh, transformer=transformer,
                              shard=["text_encoder"],
                              dtype={"text_encoder": torch.bfloat16, "default": torch.float32})
    return {"class": type(pipe).__name__, "given": pipe.transformer is transformer,
            "loaded": sorted(pipe.result),
            "dtypes": [str(pipe.text_encoder.dtype), str(pipe.vae.dtype)],
            "sharded": [_sharded(pipe.text_encoder), _sharded(pipe.vae)]}


def test_component_choices(tmp_path):
    ckpt = save_pipeline("flux2", tmp_path / "pipe")
    for row in run_ranks(_choices, 2, str(ckpt), timeout=600):
        assert row == {"class": "Flux2Pipeline", "given": True, "loaded": ["text_encoder", "vae"],
                       "dtypes": ["torch.bfloat16", "torch.float32"], "sharded": [True, False]}


def _unshard_text_encoder(ckpt: str) -> list:
    backend = sw.init_backend("gloo")
    pipe = sw.from_pretrained(pipeline_class("flux2"), ckpt, mesh=backend.mesh(tp=2), shard=["transformer"])
    return [_sharded(pipe.transformer), _sharded(pipe.text_encoder), pipe.result["text_encoder"].bytes_read]


def test_shard_leaves_the_others_whole(tmp_path):
    ckpt = save_pipeline("flux2", tmp_path / "pipe")
    whole = sum(f.stat().st_size for f in (ckpt / "text_encoder").glob("*.safetensors"))
    for transformer, text_encoder, read in run_ranks(_unshard_text_encoder, 2, str(ckpt), timeout=600):
        assert (transformer, text_encoder) == (True, False)
        assert 0.95 * whole < read < whole  # every tensor, without the files' headers


def _distributed(ckpt: str, out: str) -> list:
    backend = sw.init_backend("gloo")
    pipe = sw.from_pretrained(pipeline_class("flux2"), ckpt, mesh=backend.mesh(tp=2))
    sw.save(pipe, out, distributed=True)
    return generate(pipe, "flux2").tolist()


def _reload(out: str) -> list:
    backend = sw.init_backend("gloo")
    pipe = sw.from_pretrained(pipeline_class("flux2"), out, mesh=backend.mesh(tp=backend.world_size))
    return generate(pipe, "flux2").tolist()


def test_distributed_save_reloads_at_another_degree(tmp_path):
    ckpt = save_pipeline("flux2", tmp_path / "pipe")
    out = tmp_path / "dcp"
    first = run_ranks(_distributed, 2, str(ckpt), str(out), timeout=600)[0]
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "Flux2Pipeline"
    for image in run_ranks(_reload, 4, str(out), timeout=600):
        assert (torch.tensor(image) - torch.tensor(first)).abs().max().item() <= TOLERANCE


def _error(ckpt: str, tp: int, **kwargs) -> str:
    backend = sw.init_backend("gloo")
    try:
        sw.from_pretrained(pipeline_class("flux2"), ckpt, mesh=backend.mesh(tp=tp), **kwargs)
    except (CheckpointError, ShardingError, UnsupportedModelError, UsageError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _plan_error(ckpt, **kwargs) -> str:
    """The error of checking a pipeline folder (what sw.from_pretrained does first), one process."""
    from shardwise.hf.pipeline import plan_components
    from shardwise.io.storage import locate

    options = {"degree": 1, "given": {}, "shard": None, "dtype": None, **kwargs}
    try:
        plan_components(pipeline_class("flux2"), locate(ckpt), **options)
    except (CheckpointError, ShardingError, UnsupportedModelError, UsageError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_bad_input_is_one_clear_error_before_any_read(tmp_path):
    ckpt = save_pipeline("flux2", tmp_path / "pipe")
    # on the ranks: 3 does not split 4 heads; the component named, the degrees that fit listed
    messages = run_ranks(_error, 3, str(ckpt), 3, timeout=300)
    assert all("component 'text_encoder'" in m and "1, 2, 4, 8" in m for m in messages), messages[0]
    message = _plan_error(ckpt, degree=3, shard=["transformer"])
    assert "component 'transformer'" in message and "1, 2, 4" in message, message
    index = json.loads((ckpt / "model_index.json").read_text())
    (ckpt / "vae").rename(tmp_path / "vae_aside")
    message = _plan_error(ckpt)
    assert "no folder 'vae'" in message and message.startswith("CheckpointError"), message
    (tmp_path / "vae_aside").rename(ckpt / "vae")
    (ckpt / "model_index.json").write_text(json.dumps({**index, "vae": ["diffusers", "NoSuchAutoencoder"]}))
    message = _plan_error(ckpt)
    assert "diffusers cannot build" in message and "NoSuchAutoencoder" in message, message
    (ckpt / "model_index.json").write_text(json.dumps({k: v for k, v in index.items() if k != "vae"}))
    assert "lists no ['vae']" in _plan_error(ckpt)
    (ckpt / "model_index.json").write_text(json.dumps(index))
    assert "shard= names ['unet']" in _plan_error(ckpt, shard=["unet"])
    assert "has no TP plan" in _plan_error(ckpt, shard=["vae"])
    assert "which is not a model" in _plan_error(ckpt, shard=["scheduler"])
    assert _plan_error(ckpt) == "no error"
