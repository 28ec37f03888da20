"""The torch distributed checkpoint (DCP) format plugin: ``.distcp`` chunk files and a pickled
``.metadata``. torch's DCP stays the engine (its planners, reader and writer); shardwise adds
canonical chunks (``items``), checked metadata (``metadata``), chunk reads and the offline
reads (``chunks``), the save and load (``checkpoint``) and optimizer state (``optim``). This
module stays light: torch.distributed.checkpoint (~1.7 s) is imported only when a DCP
checkpoint is opened or saved."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.errors import CheckpointError
from shardwise.io.formats import Capabilities

if TYPE_CHECKING:
    from shardwise.io.storage import Location

NAME = "dcp"
# FP8 weights load as stored (quantized), never dequantized per rank
CAPABILITIES = Capabilities(distributed=True, async_save=True, optimizer=True, scale_regions=True,
                            label="dcp",
                            own_checksums="each chunk is checked against the CRC-32 of its zip record")
METADATA_FILE = ".metadata"  # torch DCP writes it last: its absence means an incomplete save


def claims(path: Location) -> bool:
    """Whether ``path`` is a folder that looks like a torch distributed checkpoint, from file
    names only: it has ``.metadata`` or ``*.distcp`` files (maybe incomplete, which its
    reader then reports)."""
    return path.is_folder() and ((path / METADATA_FILE).stat() is not None or bool(path.glob("*.distcp")))


def open_source(path: Location, **options):
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
