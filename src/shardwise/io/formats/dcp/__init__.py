"""The torch distributed checkpoint (DCP) format plugin: a folder of ``.distcp`` chunk files
and a pickled ``.metadata``. torch's DCP stays the engine: loads go through its planner and
``StorageReader`` (``checkpoint``), saves through its ``StorageWriter``; shardwise adds the
canonical chunk layout (``items``), the checked metadata (``metadata``), chunk reads
(``chunks``), optimizer state (``optim``) and the offline reads (``stored``).

This module stays light: the registry imports it to ask about every path, and
torch.distributed.checkpoint (~1.7 s to import after torch) is imported only when a DCP checkpoint
is opened.
"""

from __future__ import annotations

import os
from pathlib import Path

from shardwise.errors import CheckpointError
from shardwise.io.formats import Capabilities

NAME = "dcp"
# FP8 weights load as stored (quantized), never dequantized per rank
CAPABILITIES = Capabilities(distributed=True, async_save=True, optimizer=True, scale_regions=True,
                            label="dcp",
                            own_checksums="each chunk is checked against the CRC-32 of its zip record")
METADATA_FILE = ".metadata"  # torch DCP writes it last: its absence means an incomplete save


def claims(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder that looks like a torch distributed checkpoint, from file
    names only: it has ``.metadata`` or ``*.distcp`` files (maybe incomplete, which its
    reader then reports)."""
    path = Path(path)
    return path.is_dir() and ((path / METADATA_FILE).is_file() or any(path.glob("*.distcp")))


def open_source(path: str | os.PathLike, **options):
    """The :class:`~shardwise.io.formats.dcp.checkpoint.DcpSource` of ``path``."""
    try:  # deferred: keeps torch.distributed.checkpoint (~1.7 s) off inspect/verify/diff of other formats
        from shardwise.io.formats.dcp.checkpoint import DcpSource
    except ImportError as e:
        raise CheckpointError(
            f"{path}: a torch distributed checkpoint (it has .metadata), but this shardwise "
            f"cannot read DCP checkpoints ({e}); consolidate it to safetensors first"
        ) from e
    return DcpSource(path, **options)


def save(model, path, **options):
    """Every rank writes its own regions of ``model`` through torch DCP
    (:func:`~shardwise.io.formats.dcp.checkpoint.save_dcp`); with ``async_save`` a handle."""
    # deferred: keeps torch.distributed.checkpoint (~1.7 s) off the gather save (sw.save's default)
    from shardwise.io.formats.dcp.checkpoint import save_dcp

    return save_dcp(model, path, **options)


__all__ = ["CAPABILITIES", "METADATA_FILE", "NAME", "claims", "open_source", "save"]
