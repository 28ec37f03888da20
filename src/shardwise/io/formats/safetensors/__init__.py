"""The ordinary safetensors format plugin: a ``.safetensors`` file, a folder holding one, or an
index and its files. ``files``: headers, boxes, the streaming writer and the checkpoint's plan;
``checkpoint``: folders and indexes, validated; ``keys``: matching names; ``quantized``: FP8 and
MXFP4 reads; ``source``: the Source, reading through the read floor (``io.read``). The
registry's last resort: it claims every path, and its reader names what is wrong with one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.io.formats import Capabilities
from shardwise.io.formats.safetensors.files import SafetensorsSink
from shardwise.io.formats.safetensors.source import SafetensorsSource

if TYPE_CHECKING:
    from shardwise.io.storage import Location

NAME = "safetensors"
CAPABILITIES = Capabilities(dequantizes=True, scale_regions=True, parallel_write=True, label="safetensors",
                            names="hub", files=("*.safetensors", "*.safetensors.index.json"))


def claims(path: Location) -> bool:
    """Every path: the registry asks this plugin last."""
    return True


def open_source(path: Location, **options):
    """The ``source.SafetensorsSource`` of ``path`` (``dequantize=True``: FP8 weights with block
    scales into plain model tensors)."""
    return SafetensorsSource(path, **options)


def writer(**options):
    """The ``files.SafetensorsSink`` (a ``FileSink``) configured by ``options``."""
    return SafetensorsSink(**options)


__all__ = ["CAPABILITIES", "NAME", "claims", "open_source", "writer"]
