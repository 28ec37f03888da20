"""Moving a finished checkpoint into place, and byte views: their failures are ShardwiseErrors
that stay catchable as the builtin type a caller may already catch."""

from __future__ import annotations

import errno

import pytest
import torch

import shardwise.io.storage.transaction as target_module
from shardwise.errors import CheckpointError, ShardwiseError, StorageError, UsageError
from shardwise.io.storage import byte_view


@pytest.mark.parametrize("atomic", [True, False])
def test_a_target_that_appears_while_saving_is_a_checkpoint_error(tmp_path, monkeypatch, atomic):
    if not atomic:
        monkeypatch.setattr(target_module, "_renameat2_fn", lambda: None)  # as on macOS
    elif target_module._renameat2_fn() is None:
        pytest.skip("no renameat2 here")
    src, dst = tmp_path / "new", tmp_path / "out"
    src.mkdir()
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"someone else's")
    with pytest.raises(CheckpointError, match="appeared while saving; pass overwrite=True"):
        target_module._rename_noreplace(src, dst)
    assert (dst / "model.safetensors").read_bytes() == b"someone else's" and src.is_dir()


def test_a_refused_rename_is_a_storage_error_and_an_os_error(tmp_path):
    if target_module._renameat2_fn() is None:
        pytest.skip("no renameat2 here")
    src, dst = tmp_path / "missing", tmp_path / "out"
    with pytest.raises(OSError) as e:
        target_module._rename_noreplace(src, dst)
    assert isinstance(e.value, StorageError) and isinstance(e.value, ShardwiseError)
    assert e.value.errno == errno.ENOENT
    assert (e.value.filename, e.value.filename2) == (str(src), str(dst))
    assert "check that the folder is writable" in str(e.value)


def test_byte_view_refuses_a_tensor_without_plain_bytes():
    with pytest.raises(UsageError, match="contiguous CPU tensor"):
        byte_view(torch.zeros(4, 6).t())
    t = torch.arange(-3, 3, dtype=torch.int16)
    assert bytes(byte_view(t)) == b"".join(int(x).to_bytes(2, "little", signed=True) for x in t)


@pytest.mark.parametrize("options", [{}, {"distributed": True, "format": "sharded"}])
def test_a_save_decodes_its_target_once(tmp_path, monkeypatch, options):
    import sys

    import shardwise as sw
    import shardwise.io.save  # noqa: F401  (its modules loaded, so that every binding is spied on)
    import shardwise.io.storage as storage

    calls = []
    real = storage.target_path

    def spy(location):
        calls.append(location)
        return real(location)

    for module in list(sys.modules.values()):  # every module that bound the name
        ours = getattr(module, "__name__", "").startswith("shardwise")
        if ours and getattr(module, "target_path", None) is real:
            monkeypatch.setattr(module, "target_path", spy)
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(4, 2)
    sw.save(model, "out", **options)
    assert len(calls) == 1, calls  # at the door, then handed down: the transaction does not redo it
    assert (tmp_path / "out").is_dir() and sw.verify(tmp_path / "out").ok
