"""The sharded safetensors format plugin: the rank-local files torch's
``HuggingFaceStorageWriter(save_distributed=True)`` writes (``format="sharded"``), each header's
``DCP_SHARDING_INFO`` saying where its chunks lie; ``source`` validates the chunk map and
reads, ``write`` writes. No pickle anywhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.io.formats import Capabilities
from shardwise.io.formats.sharded.source import ShardedSource, is_sharded_safetensors

if TYPE_CHECKING:
    from shardwise.io.storage import Location

NAME = "sharded"
# FP8 weights load as stored (quantized), never dequantized per rank; its files split every
# tensor evenly, so it cannot write each FP8 scale once
CAPABILITIES = Capabilities(distributed=True, quantized=False, label="sharded safetensors")


def claims(path: Location) -> bool:
    """Whether ``path`` is a folder of safetensors files whose headers carry
    ``DCP_SHARDING_INFO`` (``source.is_sharded_safetensors``)."""
    return is_sharded_safetensors(path)


def open_source(path: Location, **options):
    """The :class:`~shardwise.io.formats.sharded.source.ShardedSource` of ``path``."""
    return ShardedSource(path, **options)


def save(model, path, *, async_save: bool = False, **options):
    """Every rank writes its own chunks of ``model`` at ``path``
    (:func:`~shardwise.io.formats.sharded.write.save_sharded_safetensors`); never async
    (``CAPABILITIES.async_save``: sw.save's options refuse it)."""
    assert not async_save, "save_options refuses async_save for a format without Capabilities.async_save"
    # deferred: keeps torch.distributed.checkpoint (~1.7 s, via dcp.checkpoint) off the gather save
    from shardwise.io.formats.sharded.write import save_sharded_safetensors

    return save_sharded_safetensors(model, path, **options)


__all__ = ["CAPABILITIES", "NAME", "claims", "open_source", "save"]
