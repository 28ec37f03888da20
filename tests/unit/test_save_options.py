"""sw.save refuses options that do not apply to the kind of save asked for, rather than
ignoring them (a distributed save has no file size limit, prefix, hub layout or parallel
writer; ``format`` picks between distributed formats only). Checked before any collective
or write, so a plain model in one process shows it."""

from __future__ import annotations

import pytest
from torch import nn

import shardwise as sw


@pytest.mark.parametrize("option", [{"max_shard_size": "1GB"}, {"filename_prefix": "shard"},
                                    {"layout": "module"}, {"parallel_write": True}])
def test_distributed_save_refuses_gather_save_options(tmp_path, option):
    name = next(iter(option))
    with pytest.raises(sw.UsageError, match=f"{name}=.*: not for a distributed save"):
        sw.save(nn.Linear(4, 4), tmp_path / "out", distributed=True, **option)
    assert not (tmp_path / "out").exists()


def test_format_without_distributed_is_refused(tmp_path):
    with pytest.raises(sw.UsageError, match="format='safetensors' applies to a distributed save only"):
        sw.save(nn.Linear(4, 4), tmp_path / "out", format="safetensors")
    assert not (tmp_path / "out").exists()
