"""Checkpoint formats as plugins, and the one registry that knows their order.

Each format is a package under ``shardwise.io.formats`` whose ``__init__`` offers ``NAME``,
``DEQUANTIZES`` (whether it can read FP8 weights into plain model tensors), ``claims(path)``
("is this mine?") and ``open_source(path, **options)`` (its
:class:`~shardwise.io.source.OpenedSource`). The registry imports each plugin it asks, so a
format whose reader is slow to import imports it only in ``open_source`` (DCP:
torch.distributed.checkpoint, ~1.7 s).
:func:`open_source` is how ``sw.load``, ``sw.consolidate``, ``sw.verify``, ``sw.diff`` and
``shardwise inspect`` open a checkpoint: the first format, in :data:`FORMATS` order, that
claims the path.

The order matters: a DCP folder is told by its file names alone (``.metadata``, ``*.distcp``),
so it is asked first; sharded safetensors (headers carrying ``DCP_SHARDING_INFO``) next;
ordinary safetensors claims whatever is left, and its reader names what is wrong with a path
that holds no checkpoint.

Adding a format is one new folder and one line here. A format ``zarr`` would be
``shardwise/io/formats/zarr/__init__.py`` (``NAME = "zarr"``, ``DEQUANTIZES``, ``claims``,
``open_source``) and the line ``"zarr": "shardwise.io.formats.zarr",`` placed in
:data:`FORMATS` before the formats that would also claim its paths.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import TYPE_CHECKING

from shardwise.errors import UsageError
from shardwise.io.storage import Location, locate

if TYPE_CHECKING:
    from shardwise.io.source import OpenedSource

# name -> plugin package, in the order they are asked whether a path is theirs
FORMATS: dict[str, str] = {
    "dcp": "shardwise.io.formats.dcp",
    "sharded": "shardwise.io.formats.sharded",
    "safetensors": "shardwise.io.formats.safetensors",
}


def register_format(name: str, module: str, *, before: str | None = None) -> None:
    """Add the format plugin ``module`` (a package path) as ``name``, asked just before the
    format ``before`` (default: before the last resort, ``safetensors``). Raises ``UsageError``
    for a name already registered or an unknown ``before``."""
    if name in FORMATS:
        raise UsageError(f"a checkpoint format named {name!r} is already registered "
                         f"({FORMATS[name]}); known formats: {', '.join(FORMATS)}")
    before = "safetensors" if before is None else before
    if before not in FORMATS:
        raise UsageError(f"no checkpoint format named {before!r} to insert {name!r} before; "
                         f"known formats: {', '.join(FORMATS)}")
    items = list(FORMATS.items())
    items.insert(list(FORMATS).index(before), (name, module))
    FORMATS.clear()
    FORMATS.update(items)


def get_format(name: str) -> ModuleType:
    """The plugin module of the format ``name``; raises ``UsageError`` listing the known
    names for an unknown one."""
    try:
        module = FORMATS[name]
    except KeyError:
        raise UsageError(f"no checkpoint format named {name!r}; known formats: "
                         f"{', '.join(FORMATS)}") from None
    return importlib.import_module(module)


def format_of(path: Location) -> ModuleType:
    """The plugin of the first format, in :data:`FORMATS` order, that claims ``path``."""
    for name in FORMATS:
        plugin = get_format(name)
        if plugin.claims(path):
            return plugin
    raise UsageError(f"{path}: no checkpoint format claims it; known formats: {', '.join(FORMATS)}")


def open_source(path: Location | str | os.PathLike, *, dequantize: bool = False) -> OpenedSource:
    """The :class:`~shardwise.io.source.OpenedSource` of the checkpoint at ``path``, its format
    detected once (:func:`format_of`). ``dequantize``: FP8 weights with block scales into
    plain model tensors, for the formats that can (ordinary safetensors); asking it of
    another raises ``UsageError``.

    >>> source = open_source(locate("out/dcp"))                                    # doctest: +SKIP
    >>> source.name, len(source.tensors())                                 # doctest: +SKIP
    ('dcp', 291)
    """
    path = locate(path)  # a str or path: the tools' and tests' door (sw.* pass Locations)
    plugin = format_of(path)
    if dequantize and not plugin.DEQUANTIZES:
        raise UsageError(f"{path}: dequantize=True reads FP8 safetensors checkpoints (weights with their "
                         "block scales); this is a distributed checkpoint: load it into the quantized "
                         "model it was saved from")
    return plugin.open_source(path, dequantize=True) if dequantize else plugin.open_source(path)


__all__ = ["FORMATS", "format_of", "get_format", "open_source", "register_format"]
