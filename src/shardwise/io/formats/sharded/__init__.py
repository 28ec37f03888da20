"""The sharded safetensors format plugin: the rank-local safetensors files torch's
``HuggingFaceStorageWriter(save_distributed=True)`` writes (and so transformers'
``save_pretrained(..., distributed_checkpoint=True)`` and shardwise's
``save(..., distributed=True, format="safetensors")``), each header's ``DCP_SHARDING_INFO``
saying where its chunks lie. ``checkpoint``: the format and its validated chunk map;
``source``: the reads. No pickle anywhere.
"""

from __future__ import annotations

import os

from shardwise.io.formats.sharded.checkpoint import is_sharded_safetensors
from shardwise.io.formats.sharded.source import ShardedSource

NAME = "sharded"
DEQUANTIZES = False  # FP8 weights load as stored (quantized), never dequantized per rank
TIED_SCALES = False  # tensors split evenly: no scales of blocks a boundary cuts


def claims(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder of safetensors files whose headers carry
    ``DCP_SHARDING_INFO`` (and no index); reads the files' headers, and a corrupt header
    raises ``CheckpointError`` naming the file."""
    return is_sharded_safetensors(path)


def open_source(path: str | os.PathLike, **options):
    """The :class:`~shardwise.io.formats.sharded.source.ShardedSource` of ``path``."""
    return ShardedSource(path, **options)


__all__ = ["DEQUANTIZES", "NAME", "claims", "open_source"]
