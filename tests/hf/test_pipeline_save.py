"""sw.save(pipe, path) is one storage transaction: a save that fails on a rank, or whose process
is killed, leaves nothing at ``path`` (a killed one leaves its hidden folder, which the next save
removes); ``overwrite=True`` replaces a pipeline folder (its index and components) only."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from pipeline_models import build_pipeline, generate, pipeline_class, save_pipeline  # noqa: E402

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402
from shardwise.errors import ShardwiseError  # noqa: E402
from shardwise.testing import RankFailure  # noqa: E402

TOLERANCE = 1e-4


def _interrupted(ckpt: str, out: str, how: str) -> str:
    """Save the pipeline; the tokenizer's save (rank 0's, after every model's) raises
    (``how="raise"``) or kills the process (``"kill"``)."""
    backend = sw.init_backend("gloo")
    pipe = sw.from_pretrained(pipeline_class("flux2"), ckpt, mesh=backend.mesh(tp=backend.world_size))

    def fail(*args, **kwargs):
        if how == "kill":
            os._exit(3)  # no cleanup runs: as a killed job
        raise OSError("disk full (injected)")

    if backend.rank == 0:
        pipe.tokenizer.save_pretrained = fail
    try:
        sw.save(pipe, out)
    except Exception as e:  # noqa: BLE001 - rank 0 its OSError, the others the CollectiveError naming it
        return f"{type(e).__name__}: {e}"
    return "saved"


def _save(ckpt: str, out: str) -> str:
    backend = sw.init_backend("gloo")
    pipe = sw.from_pretrained(pipeline_class("flux2"), ckpt, mesh=backend.mesh(tp=backend.world_size))
    try:
        sw.save(pipe, out, overwrite=True)
    except ShardwiseError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


def _beside(out) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def _tree(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_failed_or_killed_save_leaves_nothing_and_the_next_one_completes(tmp_path):
    from diffusers import DiffusionPipeline

    ckpt = str(save_pipeline("flux2", tmp_path / "pipe"))
    out = tmp_path / "out"
    # rank 0's tokenizer save fails after every model is written: every rank raises, the hidden
    # folder is removed, nothing is at out
    for message in run_ranks(_interrupted, 2, ckpt, str(out), "raise", timeout=600):
        assert "disk full (injected)" in message, message
    assert not out.exists() and _beside(out) == []
    # killed: the hidden folder stays (nothing runs after a kill), out does not exist
    with pytest.raises(RankFailure):
        run_ranks(_interrupted, 1, ckpt, str(out), "kill", timeout=600)
    assert not out.exists()
    left = _beside(out)
    assert len(left) == 1 and ".shardwise-tmp-" in left[0], left
    assert (tmp_path / left[0] / "text_encoder").is_dir()  # the models were written into it
    # the next save removes the killed one's folder and completes
    assert run_ranks(_save, 2, ckpt, str(out), timeout=600) == ["saved", "saved"]
    assert _beside(out) == []
    again = DiffusionPipeline.from_pretrained(out)
    reference = generate(build_pipeline("flux2"), "flux2")
    assert (generate(again, "flux2") - reference).abs().max().item() <= TOLERANCE


def _save_plain(ckpt: str, out: str) -> str:
    backend = sw.init_backend("gloo")
    pipe = sw.from_pretrained(pipeline_class("flux2"), ckpt, mesh=backend.mesh(tp=backend.world_size))
    try:
        sw.save(pipe, out)
    except ShardwiseError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


def test_overwrite_replaces_a_pipeline_folder_and_nothing_else(tmp_path):
    ckpt, out = str(save_pipeline("flux2", tmp_path / "pipe")), tmp_path / "out"
    assert run_ranks(_save_plain, 2, ckpt, str(out), timeout=600) == ["saved", "saved"]
    before = _tree(out)
    (out / "transformer" / "stale.bin").write_bytes(b"from an older save")  # inside a component: replaced
    # without overwrite: refused before writing, on every rank
    for message in run_ranks(_save_plain, 2, ckpt, str(out), timeout=600):
        assert message.startswith("UsageError") and "pass overwrite=True" in message, message
    assert _tree(out) == {**before, "transformer/stale.bin": b"from an older save"} and _beside(out) == []
    # with overwrite: the pipeline folder replaced whole, byte for byte what the first save wrote
    assert run_ranks(_save, 2, ckpt, str(out), timeout=600) == ["saved", "saved"]
    after = _tree(out)
    assert after == before, sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert _beside(out) == []
    # a file of the user's beside the components is refused, and the folder left as it was
    (out / "notes.txt").write_text("mine")
    for message in run_ranks(_save, 2, ckpt, str(out), timeout=600):
        assert "notes.txt" in message and "not a checkpoint file" in message, message
    assert _tree(out) == {**before, "notes.txt": b"mine"} and _beside(out) == []
    # a folder that is no pipeline (no model_index.json) is refused, and left as it was
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for message in run_ranks(_save, 2, ckpt, str(other), timeout=600):
        assert message.startswith("UsageError") and "holds no model_index.json" in message, message
    assert _tree(other) == {"notes.txt": b"mine"}
