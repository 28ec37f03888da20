"""Checkpoint formats as plugins: the one registry, its names, and what each format can do
(:class:`Capabilities`, which the pipelines ask instead of a name). A format is a package
offering ``NAME``, ``CAPABILITIES``, ``claims(path)``, ``open_source(path, **options)`` and, by
``CAPABILITIES.distributed``, a gathered ``writer(**options)`` (a ``FileSink``) or a distributed
``save(model, path, **options)``; without either it is read only. Slow imports go inside those
functions. Reading asks DCP, then sharded safetensors, then safetensors, the last resort."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from shardwise.core.adapter import side_file_names
from shardwise.errors import UsageError
from shardwise.io.info import INFO_FILE
from shardwise.io.storage import Location, locate

if TYPE_CHECKING:
    from shardwise.io.source import OpenedSource


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a format can do, declared by its plugin. ``dequantizes``: reads FP8 weights with
    block scales into plain model tensors per rank; ``distributed``: every rank writes its own
    part (else rank 0 writes what is gathered); ``async_save``: its save can return before the
    data is written; ``optimizer``: holds optimizer state; ``quantized``: writes FP8 weights and
    each scale once; ``scale_regions``: reads each FP8 scale at its own region (shard boundaries
    may cut scale blocks); ``parallel_write``: its gathered files can be laid out up front and
    written by every rank; ``label``: what reports call it; ``names``: the names its checkpoints
    mostly hold (``"hub"`` or ``"module"``); ``own_checksums``: what it stores to check its bytes;
    ``files``: the names (``fnmatch`` patterns) its writer puts in a checkpoint folder, which a
    save with ``overwrite=True`` may replace (:func:`checkpoint_files`).

    >>> Capabilities(distributed=True).async_save
    False
    """

    dequantizes: bool = False
    distributed: bool = False
    async_save: bool = False
    optimizer: bool = False
    quantized: bool = True
    scale_regions: bool = False
    parallel_write: bool = False
    label: str = ""
    names: str = "module"
    own_checksums: str | None = None
    files: tuple[str, ...] = ()


# name -> plugin package, in the order they are asked whether a path is theirs
FORMATS: dict[str, str] = {
    "dcp": "shardwise.io.formats.dcp",
    "sharded": "shardwise.io.formats.sharded",
    "safetensors": "shardwise.io.formats.safetensors",
}

# sw.save's documented spellings: (format=, distributed=) -> the registry's name
SAVE_SPELLINGS: dict[tuple[str | None, bool], str] = {
    (None, False): "safetensors", (None, True): "dcp",
    ("distcp", True): "dcp", ("distcp", False): "dcp", ("safetensors", True): "sharded",
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


def format_of(path: Location | str | os.PathLike) -> ModuleType:
    """The plugin of the first format, in :data:`FORMATS` order, that claims ``path``."""
    path = locate(path)  # a str or path: the tools' and tests' door (sw.* pass Locations)
    for name in FORMATS:
        plugin = get_format(name)
        if plugin.claims(path):
            return plugin
    raise UsageError(f"{path}: no checkpoint format claims it; known formats: {', '.join(FORMATS)}")


def open_source(path: Location | str | os.PathLike, *, dequantize: bool = False) -> OpenedSource:
    """The ``OpenedSource`` of the checkpoint at ``path``, its format detected once.
    ``dequantize``: FP8 weights with block scales into plain model tensors, for the formats that
    can (``Capabilities.dequantizes``); asking it of another raises ``UsageError``.

    >>> source = open_source(locate("out/dcp"))                                    # doctest: +SKIP
    >>> source.name, len(source.tensors())                                 # doctest: +SKIP
    ('dcp', 291)
    """
    path = locate(path)  # a str or path: the tools' and tests' door (sw.* pass Locations)
    plugin = format_of(path)
    if dequantize and not plugin.CAPABILITIES.dequantizes:
        raise UsageError(f"{path}: dequantize=True reads FP8 safetensors checkpoints (weights with their "
                         f"block scales); this is a {plugin.NAME} checkpoint: load it into the quantized "
                         "model it was saved from")
    return plugin.open_source(path, dequantize=True) if dequantize else plugin.open_source(path)


def checkpoint_files() -> tuple[str, ...]:
    """What a save may replace (``overwrite=True``), as the storage's transaction is told: the
    files every registered format writes (``Capabilities.files``: a save replaces a checkpoint of
    any format), ``shardwise.json`` and the model adapters' side files. Anything else in the
    folder is someone else's: the save refuses it.

    >>> "*.distcp" in checkpoint_files() and "shardwise.json" in checkpoint_files()
    True
    """
    names = [p for name in FORMATS for p in get_format(name).CAPABILITIES.files]
    return tuple(dict.fromkeys([*names, INFO_FILE, *side_file_names()]))


def save_format(format: str | None, *, distributed: bool) -> ModuleType:
    """The plugin that writes ``sw.save(..., format=format, distributed=distributed)``:
    ``format`` is a registry name or one of :data:`SAVE_SPELLINGS` (None: the default of the
    kind of save). Raises ``UsageError`` for an unknown name, a read-only format, or a
    format of the other kind (naming the fix)."""
    name = SAVE_SPELLINGS.get((format, distributed), format)
    if not isinstance(name, str):
        raise UsageError(f"format must be the name of a checkpoint format, got {format!r}")
    def writes(plugin: ModuleType) -> bool:
        return hasattr(plugin, "save" if plugin.CAPABILITIES.distributed else "writer")

    plugin = get_format(name)
    if not writes(plugin):
        writable = [n for n in FORMATS if writes(get_format(n))]
        raise UsageError(f"format={format!r}: the {name} format is read only (it has no writer); "
                         f"writable formats: {', '.join(writable)}")
    if plugin.CAPABILITIES.distributed and not distributed:
        raise UsageError(f"format={format!r} writes a distributed checkpoint (every rank its own part); "
                         "pass distributed=True too")
    if distributed and not plugin.CAPABILITIES.distributed:
        raise UsageError(f"format={format!r} is written by rank 0 from the gathered tensors; drop "
                         "distributed=True, or pick a distributed format (dcp, sharded)")
    return plugin


__all__ = ["FORMATS", "SAVE_SPELLINGS", "Capabilities", "checkpoint_files", "format_of", "get_format",
           "open_source", "register_format", "save_format"]
