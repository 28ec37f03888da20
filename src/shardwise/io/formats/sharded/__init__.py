"""The sharded safetensors format plugin: the rank-local files torch's
``HuggingFaceStorageWriter(save_distributed=True)`` writes (``format="sharded"``), each header's
``DCP_SHARDING_INFO`` saying where its chunks lie; ``source`` validates the chunk map and
reads, ``write`` writes. No pickle anywhere."""

from __future__ import annotations

from shardwise.io.formats import Capabilities

# the plugin's claims(path) and open_source(path) (the headers carry DCP_SHARDING_INFO; a
# ShardedSource validates the chunk map on opening)
from shardwise.io.formats.sharded.source import ShardedSource as open_source
from shardwise.io.formats.sharded.source import is_sharded_safetensors as claims
from shardwise.io.formats.sharded.write import save_sharded_safetensors

NAME = "sharded"
# FP8 weights load as stored (quantized), never dequantized per rank; its files split every
# tensor evenly, so it cannot write each FP8 scale once
CAPABILITIES = Capabilities(distributed=True, quantized=False, label="sharded safetensors",
                            files=("*.safetensors",))


def save(model, path, *, async_save: bool = False, **options):
    """Every rank writes its own chunks of ``model`` at ``path``
    (:func:`~shardwise.io.formats.sharded.write.save_sharded_safetensors`); never async
    (``CAPABILITIES.async_save``: sw.save's options refuse it)."""
    assert not async_save, "save_options refuses async_save for a format without Capabilities.async_save"
    return save_sharded_safetensors(model, path, **options)


__all__ = ["CAPABILITIES", "NAME", "claims", "open_source", "save"]
