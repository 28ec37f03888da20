"""overwrite=True replaces a folder that holds a Hugging Face checkpoint's config files or any
format's files (as the formats declare them), and still refuses one holding anything else."""

import pytest
from torch import nn

import shardwise as sw
from shardwise.core.adapter import adapter_for
from shardwise.hf.adapter import ADAPTER


def _hf_folder(folder, *extra):
    sw.save(nn.Linear(4, 4), folder)
    for name in ("config.json", "generation_config.json", *extra):
        (folder / name).write_text("{}")


def test_overwrite_replaces_a_folder_with_config_files(tmp_path):
    _hf_folder(tmp_path / "ckpt")
    with pytest.raises(sw.CheckpointError, match="overwrite=True"):
        sw.save(nn.Linear(4, 2), tmp_path / "ckpt")
    sw.save(nn.Linear(4, 2), tmp_path / "ckpt", overwrite=True)
    # a plain model has no config: the new checkpoint is what it wrote, nothing older is left
    assert not (tmp_path / "ckpt" / "config.json").exists()
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()


def test_overwrite_still_refuses_other_files(tmp_path):
    _hf_folder(tmp_path / "ckpt", "tokenizer.json")
    with pytest.raises(sw.CheckpointError, match="tokenizer.json"):
        sw.save(nn.Linear(4, 2), tmp_path / "ckpt", overwrite=True)
    assert (tmp_path / "ckpt" / "tokenizer.json").exists()


def test_a_plain_model_has_no_side_files(tmp_path):
    model = nn.Linear(4, 2)
    assert ADAPTER.write_side_files(model, tmp_path) == [] and list(tmp_path.iterdir()) == []
    assert ADAPTER.file_prefix(model) == "model"
    # parameters only, each once: the index's total_parameters as transformers counts it
    shapes = {"weight": (2, 4), "bias": (2,), "running": (7,)}
    assert adapter_for(model).index_metadata(model, shapes) == {"total_parameters": 10}


def test_overwrite_replaces_a_checkpoint_of_another_format_and_refuses_a_foreign_file(tmp_path):
    # the formats declare what they write (Capabilities.files): a save replaces any of them
    sw.save(nn.Linear(4, 4), tmp_path / "ckpt", distributed=True, format="dcp")
    sw.save(nn.Linear(4, 2), tmp_path / "ckpt", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["model.safetensors", "shardwise.json"]
    sw.save(nn.Linear(4, 2), tmp_path / "ckpt", distributed=True, format="dcp", overwrite=True)
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    for options in ({}, {"distributed": True, "format": "sharded"}):
        with pytest.raises(sw.CheckpointError, match="notes.txt"):
            sw.save(nn.Linear(4, 2), tmp_path / "ckpt", overwrite=True, **options)
    assert (tmp_path / "ckpt" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "ckpt" / ".metadata").exists()


def test_the_transaction_replaces_only_the_names_it_is_told(tmp_path):
    from shardwise.io.formats import checkpoint_files
    from shardwise.io.storage import locate

    target = locate(tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "a.distcp").write_bytes(b"x")
    with pytest.raises(sw.CheckpointError, match="a.distcp"):  # told nothing: nothing is replaceable
        target.storage.transaction(target, overwrite=True).prepare()
    with pytest.raises(sw.CheckpointError, match="a.distcp"):
        target.storage.transaction(target, overwrite=True, replaceable=("*.safetensors",)).prepare()
    txn = target.storage.transaction(target, overwrite=True, replaceable=checkpoint_files())
    txn.prepare()  # the formats' names: DCP's chunk files among them
    txn.discard()
    assert set(checkpoint_files()) >= {"*.safetensors", "*.safetensors.index.json", ".metadata", "*.distcp",
                                       "shardwise.json", "config.json", "generation_config.json"}
