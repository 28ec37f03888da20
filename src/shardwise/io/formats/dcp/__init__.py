"""The torch distributed checkpoint (DCP) format plugin: ``.distcp`` chunk files and a pickled
``.metadata``, through torch's DCP planners, reader and writer: canonical chunks (``items``),
checked metadata and chunk reads (``metadata``), save and load (``checkpoint``), optimizer
state (``optim``). torch.distributed.checkpoint (~1.7 s) is imported only on use."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

from shardwise.errors import CheckpointError
from shardwise.io.formats import Capabilities

if TYPE_CHECKING:
    from shardwise.io.storage import Location

NAME = "dcp"
# FP8 weights load as stored (quantized), never dequantized per rank
CAPABILITIES = Capabilities(distributed=True, async_save=True, optimizer=True, scale_regions=True,
                            label="dcp", files=(".metadata", "*.distcp"),
                            own_checksums="each chunk is checked against the CRC-32 of its zip record")
METADATA_FILE = ".metadata"  # torch DCP writes it last: its absence means an incomplete save


def claims(path: Location) -> bool:
    """Whether ``path`` is a folder holding ``.metadata`` or ``*.distcp`` files (file names only;
    an incomplete checkpoint is reported by its reader)."""
    return path.is_folder() and ((path / METADATA_FILE).stat() is not None or bool(path.glob("*.distcp")))


def open_source(path: Location, **options):
    """The :class:`~shardwise.io.formats.dcp.checkpoint.DcpSource` of ``path``."""
    return _checkpoint(path).DcpSource(path, **options)


def save(model, path, **options):
    """Every rank writes its own regions of ``model`` (``checkpoint.save_dcp``)."""
    return _checkpoint(path).save_dcp(model, path, **options)


def _checkpoint(path: Location) -> ModuleType:
    """``checkpoint``, imported on the first DCP read or write. Deferred: the registry imports this
    package to ask ``claims`` of every path, and torch.distributed.checkpoint (~1.7 s, with
    torch.distributed.elastic) stays off every safetensors load and save."""
    try:
        from shardwise.io.formats.dcp import checkpoint
    except ImportError as e:
        raise CheckpointError(
            f"{path}: a torch distributed checkpoint (it has .metadata), but this shardwise "
            f"cannot read or write DCP checkpoints ({e}); consolidate it to safetensors first"
        ) from e
    return checkpoint


__all__ = ["CAPABILITIES", "METADATA_FILE", "NAME", "claims", "open_source", "save"]
