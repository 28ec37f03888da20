"""What kind of checkpoint a path holds, from its file names only (no file is opened), so
the dispatchers (``sw.load``, ``sw.consolidate``, ``inspect``, ``verify``, ``diff``) agree and
none of them imports torch.distributed.checkpoint to find out.
"""

from __future__ import annotations

import os
from pathlib import Path

METADATA_FILE = ".metadata"  # torch DCP writes it last: its absence means an incomplete save


def is_dcp(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder that looks like a torch distributed checkpoint (it has
    ``.metadata`` or ``*.distcp`` files; maybe incomplete, which its reader then reports)."""
    path = Path(path)
    return path.is_dir() and ((path / METADATA_FILE).is_file() or any(path.glob("*.distcp")))


__all__ = ["METADATA_FILE", "is_dcp"]
