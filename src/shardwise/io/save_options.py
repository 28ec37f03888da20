"""``sw.save``'s keyword arguments, decoded once at the door into one frozen options value per
kind of save: :class:`SafetensorsSave` (the gather save: one ordinary safetensors checkpoint)
or :class:`DistributedSave` (every rank writes its own part). An argument that does not apply
to the kind asked for is refused, naming it, never ignored; each value is checked in the
options' ``__post_init__``, one rule per raise, before any collective or write.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.errors import CheckpointError, UsageError
from shardwise.io.formats import save_format
from shardwise.io.formats.safetensors.files import parse_size

LAYOUTS = ("hub", "module")


@dataclass(frozen=True, kw_only=True)
class SafetensorsSave:
    """The gather save's options (``sw.save(..., distributed=False)``): files of at most
    ``max_shard_size`` named ``{filename_prefix}...`` (None or "": the model's default prefix),
    the ``layout`` (``"hub"`` or ``"module"``), ``parallel_write`` (True, False or None) and the
    gathered ``format`` (a registry name) whose writer rank 0 runs.

    >>> SafetensorsSave(max_shard_size="2GB", layout="module").format
    'safetensors'
    """

    max_shard_size: int | str = "5GB"
    filename_prefix: str | None = None
    layout: str = "hub"
    parallel_write: bool | None = None
    format: str = "safetensors"

    def __post_init__(self):
        parse_size(self.max_shard_size)  # CheckpointError naming the size and the units
        prefix = self.filename_prefix
        # "" means the default, as None does (sw.save always read it so)
        if prefix is not None and (not isinstance(prefix, str) or "/" in prefix or "\\" in prefix):
            raise CheckpointError(f"filename_prefix {prefix!r} must be a plain file name (no folder)")
        if self.layout not in LAYOUTS:
            raise CheckpointError(f"layout must be 'hub' or 'module', got {self.layout!r}")
        if self.parallel_write is not None and not isinstance(self.parallel_write, bool):
            raise UsageError(f"parallel_write must be True, False or None, got {self.parallel_write!r}")


@dataclass(frozen=True, kw_only=True)
class DistributedSave:
    """The distributed save's options (``sw.save(..., distributed=True)``): the ``format`` (a
    registry name: ``"dcp"``, torch's DCP files; ``"sharded"``, rank-local safetensors files)
    and ``async_save`` (for a format whose ``Capabilities.async_save``).

    >>> DistributedSave(format="sharded")
    DistributedSave(format='sharded', async_save=False)
    """

    format: str = "dcp"
    async_save: bool = False

    def __post_init__(self):
        if not isinstance(self.async_save, bool):
            raise UsageError(f"async_save must be True or False, got {self.async_save!r}")


# sw.save's defaults of the options that apply to one kind of save only: a value other than
# its default, given to the other kind, is refused (the default itself changes nothing).
_GATHER_DEFAULTS = {f: getattr(SafetensorsSave(), f) for f in
                    ("max_shard_size", "filename_prefix", "layout", "parallel_write")}


def save_options(*, distributed: bool, format: str | None = None, async_save: bool = False,
                 **kwargs) -> SafetensorsSave | DistributedSave:
    """The options value of ``sw.save(..., distributed=distributed, format=format, **kwargs)``,
    where ``kwargs`` are the gather save's options (those of :class:`SafetensorsSave`) and
    ``format`` is decoded by the registry (``shardwise.io.formats.save_format``: its names,
    and sw.save's documented spellings). Raises ``UsageError`` for an option of the other kind
    of save (naming it and the kind), or the options' own error for a bad value.

    >>> save_options(distributed=True, format="safetensors", max_shard_size="5GB")
    DistributedSave(format='sharded', async_save=False)
    """
    unknown = set(kwargs) - set(_GATHER_DEFAULTS)
    assert not unknown, f"not a save option: {sorted(unknown)}"
    if not isinstance(distributed, bool):
        raise UsageError(f"distributed must be True or False, got {distributed!r}")
    gather = {k: kwargs.get(k, d) for k, d in _GATHER_DEFAULTS.items()}
    if async_save and not distributed:
        raise UsageError("async_save=True writes a distributed checkpoint; pass distributed=True too")
    plugin = save_format(format, distributed=distributed)
    if not distributed:
        return SafetensorsSave(**gather, format=plugin.NAME)
    ignored = [f"{k}={v!r}" for k, v in gather.items() if v != _GATHER_DEFAULTS[k]]
    if ignored:
        raise UsageError(f"{', '.join(ignored)}: not for a distributed save (every rank writes its "
                         "own part, in the module's names); drop it, or save with distributed=False "
                         "and sw.consolidate the distributed checkpoint")
    if async_save is True and not plugin.CAPABILITIES.async_save:
        raise UsageError(f"async_save=True is not supported with format={format!r}; use format='dcp' "
                         "(the default) for an async distributed save")
    return DistributedSave(format=plugin.NAME, async_save=async_save)


__all__ = ["DistributedSave", "SafetensorsSave", "save_options"]
