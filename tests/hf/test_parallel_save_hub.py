"""sw.save with every rank writing its own regions, in the hub layout (per-expert tensors as
boxes of fused model tensors; HRM-Text's fused gqkv_proj, made of four model tensors): the
files save_pretrained wrote, byte for byte, at tp=2 and at ep=2 x tp=2, and the same bytes as
the rank-0 stream."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402
from hf import hf_models  # noqa: E402


def _save_both_ways(kind: str, folder: str, out: str, axes: dict) -> bool:
    backend = sw.init_backend("gloo")
    with sw.empty_model():
        model = hf_models.model_class(kind)._from_config(hf_models.KINDS[kind][2]())
    sw.load(model, folder, plan="auto", mesh=backend.mesh(**axes))
    for how, parallel in (("stream", False), ("parallel", True)):
        sw.save(model, f"{out}-{how}", max_shard_size=hf_models.SHARD_SIZE, parallel_write=parallel)
    return True


@pytest.mark.parametrize(("kind", "axes"), [("qwen3_moe", {"tp": 2}), ("qwen3_moe", {"ep": 2, "tp": 2}),
                                           ("hrm_text", {"tp": 2})],
                         ids=["tp2", "ep2xtp2", "fused-tp2"])
def test_hub_layout_written_in_parallel_is_save_pretrained_byte_for_byte(tmp_path, kind, axes):
    folder = hf_models.save_tiny(kind, tmp_path / "ckpt")
    world = axes.get("ep", 1) * axes["tp"]
    out = tmp_path / "out"
    assert run_ranks(_save_both_ways, world, kind, str(folder), str(out), axes,
                     timeout=240) == [True] * world
    stream, parallel = tmp_path / "out-stream", tmp_path / "out-parallel"
    assert sorted(p.name for p in parallel.iterdir()) == sorted(p.name for p in stream.iterdir())
    for f in sorted(stream.iterdir()):  # shardwise.json's checksums, read back from disk, too
        assert (parallel / f.name).read_bytes() == f.read_bytes(), f.name
    for f in sorted(folder.iterdir()):
        assert (parallel / f.name).read_bytes() == f.read_bytes(), f.name
    assert sw.verify(parallel).ok
