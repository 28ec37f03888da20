"""The ordinary safetensors format plugin: a ``.safetensors`` file, a folder holding one, or an
index and its files. ``files``: headers, boxes, the streaming writer and the checkpoint's plan;
``checkpoint``: folders and indexes, validated; ``keys``: matching names; ``reader`` and
``mapped``: region reads; ``quantized``: FP8 and MXFP4 reads; ``source``: the Source. The
registry's last resort: it claims every path, and its reader names what is wrong with one.
"""

from __future__ import annotations

from types import ModuleType
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
    """The ``source.SafetensorsSource`` of ``path`` (``dequantize=True``: FP8 weights with block
    scales into plain model tensors)."""
    return _modules()[1].SafetensorsSource(path, **options)


def writer(**options):
    """The ``files.SafetensorsSink`` (a ``FileSink``) configured by ``options``."""
    return _modules()[0].SafetensorsSink(**options)


def _modules() -> tuple[ModuleType, ModuleType]:
    """``(files, source)``, imported on the first read or write. Deferred: the registry imports
    this package to ask ``claims`` of every path, and ``source`` reads through ``io.exchange``,
    which imports this package's ``reader``: imported here at the top, the exchange would find
    this package half built."""
    from shardwise.io.formats.safetensors import files, source

    return files, source


__all__ = ["CAPABILITIES", "NAME", "claims", "open_source", "writer"]
