"""The ordinary safetensors format plugin: one ``.safetensors`` file, a folder holding one,
or an index (``*.safetensors.index.json``, any prefix) and its files; tensors in the model's
names or in a transformers hub layout; FP8 block-scaled and MXFP4 weights kept quantized or
dequantized per rank. ``checkpoint``: folders and indexes, validated; ``reader`` and
``mapped``: region reads; ``quantized``: tied weight/scale reads; ``source``: the Source;
``stored``: the offline reads; ``headers``: what shardwise's writers put in headers.

It is the registry's last resort: it claims every path, and its reader names what is wrong
with one that holds no safetensors checkpoint.
"""

from __future__ import annotations

import os

NAME = "safetensors"
DEQUANTIZES = True
TIED_SCALES = True  # each rank reads its regions of a quantized weight's scales


def claims(path: str | os.PathLike) -> bool:
    """Every path: the registry asks this plugin last."""
    return True


def open_source(path: str | os.PathLike, **options):
    """The :class:`~shardwise.io.formats.safetensors.source.SafetensorsSource` of ``path``
    (``dequantize=True``: FP8 weights with block scales into plain model tensors)."""
    # deferred: a cycle (io.pipeline imports .checkpoint, so this __init__; source imports io.pipeline)
    from shardwise.io.formats.safetensors.source import SafetensorsSource

    return SafetensorsSource(path, **options)


__all__ = ["DEQUANTIZES", "NAME", "claims", "open_source"]
