"""The ordinary safetensors format plugin: one ``.safetensors`` file, a folder holding one,
or an index (``*.safetensors.index.json``, any prefix) and its files; tensors in the model's
names or in a transformers hub layout; FP8 block-scaled and MXFP4 weights kept quantized or
dequantized per rank. ``checkpoint``: folders and indexes, validated; ``reader`` and
``mapped``: region reads; ``quantized``: tied weight/scale reads; ``source``: the Source;
``stored``: the offline reads; ``files``: safetensors files over a storage (headers, boxes,
the streaming writer); ``write``: the checkpoint's plan (files, order, index), its writer.

It is the registry's last resort: it claims every path, and its reader names what is wrong
with one that holds no safetensors checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise.io.storage import Location

from shardwise.io.formats import Capabilities

NAME = "safetensors"
CAPABILITIES = Capabilities(dequantizes=True, scale_regions=True, parallel_write=True, label="safetensors",
                            names="hub")


def claims(path: Location) -> bool:
    """Every path: the registry asks this plugin last."""
    return True


def open_source(path: Location, **options):
    """The :class:`~shardwise.io.formats.safetensors.source.SafetensorsSource` of ``path``
    (``dequantize=True``: FP8 weights with block scales into plain model tensors)."""
    # deferred: every module of this package (files, from the save side) runs this __init__ first;
    # the reader's imports (quantized, mapped, the key matching) load when a checkpoint is opened
    from shardwise.io.formats.safetensors.source import SafetensorsSource

    return SafetensorsSource(path, **options)


def writer(**options):
    """The :class:`~shardwise.io.formats.safetensors.files.SafetensorsSink` (a ``FileSink``)
    configured by ``options`` (``max_shard_size``, ``prefix``, ``metadata``, ...)."""
    from shardwise.io.formats.safetensors.files import SafetensorsSink

    return SafetensorsSink(**options)


__all__ = ["CAPABILITIES", "NAME", "claims", "open_source", "writer"]
