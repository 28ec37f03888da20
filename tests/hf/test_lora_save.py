"""sw.save_adapter through the storage's save transaction, interrupted: a save that fails between
its two files (on spawned gloo ranks), and a process killed there, leave nothing loadable at the
path and never touch a previous adapter; a save onto an existing adapter is refused with it intact
unless overwrite=True, which replaces it only once the new one is complete (and refuses a folder
holding anything else); the next save to the path completes."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from lora_models import make, model_class  # noqa: E402

import shardwise as sw  # noqa: E402
from harness import RankFailure, run_ranks  # noqa: E402
from shardwise.errors import CheckpointError, ShardwiseError  # noqa: E402

FILES = ("adapter_model.safetensors", "adapter_config.json")


def _model(folder: str):
    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=backend.world_size)
    model = sw.from_pretrained(model_class("llama"), f"{folder}/ckpt", mesh=mesh)
    sw.load_adapter(model, f"{folder}/a", adapter_name="a")
    return model


def _fail_between_files(folder: str) -> tuple[list[str], int]:
    import shardwise.adapters as adapters
    import shardwise.comm as comm

    model = _model(folder)
    sw.save_adapter(model, f"{folder}/previous", adapter_name="a")
    errors, gathers, refused_gathers = [], [], -1
    real_gather = comm.all_gather_inline

    def counted(*args, **kwargs):
        gathers.append(1)
        return real_gather(*args, **kwargs)

    # onto the previous adapter: refused; with overwrite, and a new path: each fails midway
    for target, overwrite in (("previous", False), ("previous", True), ("new", False)):
        real = adapters._config_text

        def boom(config):
            raise OSError("disk full (injected after the weights file was written)")

        adapters._config_text = boom
        comm.all_gather_inline = counted
        try:
            sw.save_adapter(model, f"{folder}/{target}", adapter_name="a", overwrite=overwrite)
        except (ShardwiseError, OSError) as e:  # rank 0 its own error, the others a CollectiveError
            errors.append(str(e))
        finally:
            adapters._config_text, comm.all_gather_inline = real, real_gather
        if not overwrite and target == "previous":
            refused_gathers = len(gathers)  # the gathers the refused save made
    sw.save_adapter(model, f"{folder}/new", adapter_name="a")  # then a save there completes
    sw.save_adapter(model, f"{folder}/previous", adapter_name="a", overwrite=True)  # and an overwrite
    if sw.init_backend("gloo").rank == 0:
        with open(f"{folder}/previous/notes.txt", "w") as f:
            f.write("mine")
    try:  # a file of the user's beside the adapter: refused, the folder untouched
        sw.save_adapter(model, f"{folder}/previous", adapter_name="a", overwrite=True)
    except ShardwiseError as e:
        errors.append(str(e))
    return errors, refused_gathers


def test_a_failed_save_leaves_nothing_and_the_previous_adapter_intact(tmp_path):
    make("llama", tmp_path)
    for errors, gathers in run_ranks(_fail_between_files, 2, str(tmp_path), timeout=240):
        assert "exists and is not empty" in errors[0] and "pass overwrite=True" in errors[0]
        assert gathers == 0  # refused before any gather: no collective spent on it
        assert "disk full" in errors[1] and "disk full" in errors[2]  # every rank learns rank 0's failure
        assert "notes.txt" in errors[3] and "not a checkpoint file" in errors[3], errors[3]
    weights = FILES[0]  # the previous adapter: PEFT's bytes; the retried save the same folder
    assert (tmp_path / "previous" / weights).read_bytes() == (tmp_path / "a" / weights).read_bytes()
    for name in FILES:
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "previous" / name).read_bytes()
    assert (tmp_path / "previous" / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing left aside


def _killed_between_files(folder: str) -> None:
    import shardwise.adapters as adapters

    model = _model(folder)

    def die(config):
        os._exit(9)  # killed after the weights file, before the config

    adapters._config_text = die
    sw.save_adapter(model, f"{folder}/killed", adapter_name="a")


def _load_after_kill(folder: str) -> str:
    model = _model(folder)
    try:
        sw.load_adapter(model, f"{folder}/killed", adapter_name="k")
        return "loaded"
    except CheckpointError as e:
        error = str(e)
    sw.save_adapter(model, f"{folder}/killed", adapter_name="a")  # the next save removes the leftover
    return error


def test_a_killed_save_leaves_nothing_loadable_and_the_next_save_completes(tmp_path):
    make("llama", tmp_path)
    with pytest.raises(RankFailure):
        run_ranks(_killed_between_files, 1, str(tmp_path), timeout=240)
    assert not (tmp_path / "killed").exists()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".killed")]
    assert len(aside) == 1 and (aside[0] / FILES[0]).exists()  # the weights, written aside only
    error = run_ranks(_load_after_kill, 1, str(tmp_path), timeout=240)[0]
    assert "killed" in error and "neither a PEFT folder" in error
    assert (tmp_path / "killed" / FILES[0]).read_bytes() == (tmp_path / "a" / FILES[0]).read_bytes()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
