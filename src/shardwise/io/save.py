"""``sw.save``: options -> plan -> transaction -> writer, for every format the registry writes.
The gather save plans every file on every rank (pure), then rank 0 streams them, or every rank
writes its own regions of rank 0's files (the parallel write, across machines: same bytes);
each save is one ``Saving``: complete or absent."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardwise._progress import Progress
from shardwise.adapters import saves_base
from shardwise.backends import Backend
from shardwise.comm import fingerprint
from shardwise.core.adapter import adapter_for, save_collection
from shardwise.errors import CheckpointError, CollectiveError, UsageError, on_every_rank
from shardwise.io.check.against import LAYOUTS, compare, expectations
from shardwise.io.formats import checkpoint_files, get_format, save_format
from shardwise.io.formats.safetensors.files import parse_size
from shardwise.io.gather import FileGatherer, collect_items
from shardwise.io.guards import check_model
from shardwise.io.info import gather_info
from shardwise.io.parallel_write import shared_folder, write_parallel
from shardwise.io.sink import Saving, StoredTensor
from shardwise.io.storage import Location, locate, target_path
from shardwise.mesh import world_backend
from shardwise.quant import check_quantized_save

if TYPE_CHECKING:
    from shardwise.io.formats.dcp.checkpoint import AsyncSave


@dataclass(frozen=True, kw_only=True)
class SafetensorsSave:
    """The gather save's options (``distributed=False``); ``format`` is the registry name rank 0 writes.

    >>> SafetensorsSave(max_shard_size="2GB", layout="module").format
    'safetensors'"""

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
    """The distributed save's options: ``format`` (``"dcp"`` or ``"sharded"``) and ``async_save``.

    >>> DistributedSave(format="sharded")
    DistributedSave(format='sharded', async_save=False)"""

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
    """The options value of ``sw.save(..., distributed=, format=, **kwargs)`` (``kwargs``: the
    gather options). Raises ``UsageError`` for an option of the other kind of save.

    >>> save_options(distributed=True, format="safetensors", max_shard_size="5GB")
    DistributedSave(format='sharded', async_save=False)"""
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


@saves_base  # a model with LoRA adapters (sw.load_adapter) writes its base, merged if merged
def save(model: nn.Module, path: str | os.PathLike, *, max_shard_size: int | str = "5GB",
         filename_prefix: str | None = None, metadata: Mapping[str, str] | None = None,
         overwrite: bool = False, progress: bool | None = None, distributed: bool = False,
         async_save: bool = False, format: str | None = None, layout: str = "hub",
         parallel_write: bool | None = None, storage_options: dict | None = None) -> AsyncSave | None:
    """Write ``model`` to the folder ``path`` (local, or a registered storage's URL, given
    ``storage_options``). Collective: every rank calls it; a rank left waiting over a minute raises.

    The gather save (the default) writes an ordinary safetensors checkpoint, byte-identical to
    ``save_pretrained``'s for the same ``max_shard_size``: ``{prefix}.safetensors`` or numbered
    files plus an index (``prefix``: the library's by default), ``config.json``, tied weights once,
    ``metadata`` in every header, ``shardwise.json`` with each tensor's checksum. ``layout``:
    ``"hub"`` (transformers' on-disk layout) or ``"module"`` (the module's names). Rank 0 builds
    one tensor at a time; ``parallel_write`` (None: when the ranks span machines and all see the
    folder) has every rank write its own regions, same bytes. FP8 weights and scales are written
    as stored. ``format=NAME``: another registered gathered format.

    ``distributed=True``: every rank writes its own part, ``format="dcp"`` (default; also
    ``"distcp"``; ``async_save=True`` returns a handle whose ``wait()`` every rank calls) or
    ``"sharded"`` (also ``"safetensors"``); the gather-only options are refused.

    Complete or absent: written beside ``path`` and renamed into place; an existing folder is an
    error unless ``overwrite=True`` (which refuses a folder holding other than checkpoint files).
    On any rank's failure ``path`` is untouched and every rank raises. ``progress``: a tqdm bar on
    rank 0 (default: when stderr is a tty). Returns None unless ``async_save``.

    >>> sw.save(model, "out/full", max_shard_size="2GB")                    # doctest: +SKIP
    >>> sw.load(model2, "out/full", plan=plan, mesh=backend.mesh(tp=2))     # doctest: +SKIP"""
    with on_every_rank():  # the same options, path and model on every rank, before any collective
        options = save_options(distributed=distributed, max_shard_size=max_shard_size,
                               filename_prefix=filename_prefix, layout=layout, parallel_write=parallel_write,
                               format=format, async_save=async_save)
    if not isinstance(model, nn.Module) and save_collection(model, path, dict(  # a diffusers pipeline
            max_shard_size=max_shard_size, filename_prefix=filename_prefix, metadata=metadata,
            overwrite=overwrite, progress=progress, distributed=distributed, async_save=async_save,
            format=format, layout=layout, parallel_write=parallel_write, storage_options=storage_options)):
        return None
    with on_every_rank():
        backend = world_backend()  # the API boundary: the backend of every collective of the save
        target = target_path(locate(path, storage_options))  # and the location, decoded once
        check_model(model, action="save")
        plugin = get_format(options.format)
        if not plugin.CAPABILITIES.quantized:
            check_quantized_save(model, f"as {plugin.CAPABILITIES.label} (format={format!r})")
    if isinstance(options, DistributedSave):
        join_collective(backend, "sw.save")
        return plugin.save(model, target, backend=backend, overwrite=overwrite, metadata=metadata,
                           progress=progress, async_save=options.async_save, replaceable=checkpoint_files())
    save_gathered(model, target, options, plugin, backend=backend, metadata=metadata, overwrite=overwrite,
                  progress=progress)
    return None


def save_gathered(model: nn.Module, target: Location, options: SafetensorsSave, plugin, *,
                  backend: Backend | None, metadata, overwrite: bool, progress: bool | None) -> None:
    """``sw.save(..., distributed=False)`` with its decoded ``options`` and format ``plugin``: plan
    (pure), meet, write (stream or parallel), commit when every rank is done."""
    adapter = adapter_for(model)  # its library's file prefix, index metadata, layout, side files
    prefix = options.filename_prefix or adapter.file_prefix(model)
    items, state = collect_items(model)
    if options.layout == "hub":  # the library's layout leaves some tensors out (_keys_to_ignore_on_save)
        ignored = adapter.unsaved(model)
        items = [i for i in items if i.name not in ignored]
    stored = stored_tensors(model, items, options.layout)
    check_stored(model, items, stored, options.layout)
    what = f"sw.save to {target}"
    writer = plugin.writer(
        max_shard_size=options.max_shard_size, prefix=prefix, metadata=metadata,
        index_metadata=adapter.index_metadata(model, {i.name: i.shape for i in items}),  # total_parameters
        storages=adapter.shared_storages([s.part for s in stored if s.part is not None],
                                         {i.name: i.local.element_size() for i in items}))
    plan = writer.plan(stored)
    run = FileGatherer(backend, state, {i.name: i for i in items}, plan, open_file=writer.open_file)
    parallel = _parallel_wanted(model, items, options.parallel_write, plugin, backend, target)
    join_collective(backend, "sw.save")  # after the guards and the plan: all pure
    digest = fingerprint((plan.files, [(i.name, i.spec, i.degree) for i in items], options.parallel_write))
    with Saving(target, overwrite=overwrite, backend=backend, what=what, digest=digest,
                replaceable=checkpoint_files()) as saving:
        folder = saving.folder if saving.rank0 else None
        shared = (shared_folder(backend, folder, what=what, required=options.parallel_write is True)
                  if parallel else None)
        total = sum(i.nbytes for i in items)
        with Progress(total, progress, run.rank == 0, "shardwise save (whole checkpoint)") as bar:
            checksums = (run.write(folder, bar, what=what) if shared is None else
                         write_parallel(backend, run, shared, bar, what=what))
        info = gather_info(checksums, [s.spec for s in stored]) if saving.rank0 else None
        # config.json & co beside the data: from_pretrained reads the folder
        saving.commit(info=info, side_files=lambda folder: adapter.write_side_files(model, folder),
                      index=plan.index)


HANDSHAKE_SECONDS = 60.0  # how long the first rank in a save waits for the others (at most the timeout)


def join_collective(backend: Backend | None, what: str) -> None:
    """Every rank meets here first: a rank alone in ``what`` raises within HANDSHAKE_SECONDS, naming
    the mistake, rather than hanging or failing mid-save."""
    if backend is None or backend.world_size == 1:
        return
    seconds = min(HANDSHAKE_SECONDS, backend.timeout.total_seconds())
    # A tag, not a barrier: a peer in another collective of the same shape must not pass.
    tag = torch.frombuffer(bytearray(fingerprint(what)), dtype=torch.uint8)
    cause: str | CollectiveError | None = None
    try:
        tags = backend.all_gather(tag.to(backend.device), timeout=seconds)
        others = [r for r, t in enumerate(tags) if not torch.equal(t.cpu(), tag)]
        if others:
            cause = f"rank(s) {others} are in another collective operation"
    except CollectiveError as e:
        cause = e
    if cause is not None:
        raise CollectiveError(
            f"{what} is collective: call it on every rank (not under `if rank == 0:`), at the same "
            f"point of the program; rank {backend.rank} waited up to {seconds:.0f} s and not every "
            f"rank of the {backend.world_size} joined (a peer left, is elsewhere, or arrives later: "
            f"then meet first with dist.barrier()). Cause: {cause}"
        ) from (cause if isinstance(cause, BaseException) else None)


def check_stored(model: nn.Module, items, stored, layout: str) -> None:
    """Raise ``CheckpointError`` before anything is written unless every stored tensor has the name,
    shape and dtype a checkpoint of ``model`` holds in ``layout``."""
    want = expectations(model, tensors={i.name: (i.shape, i.dtype) for i in items}, layouts=(layout,))[0]
    report = compare({s.name: (s.dtype, s.shape) for s in stored}, want)
    if not report.ok:
        raise CheckpointError(f"sw.save would write a checkpoint that does not match {type(model).__name__} "
                              f"({layout} layout): {'; '.join(report.problems()[:5])}. Nothing was written; "
                              "save with layout='module', and report this as a bug")


def stored_tensors(model: nn.Module, items, layout: str) -> list[StoredTensor]:
    """Every tensor the save writes (``StoredTensor``), in order: the model's own (``"module"``) or
    the hub layout's (``"hub"``, validated by ``SafetensorsSave``), each a box of a model tensor."""
    parts = (adapter_for(model).save_layout(model, {i.name: (i.shape, i.dtype) for i in items})
             if layout == "hub" else None)
    if parts is None:
        return [StoredTensor(i.name, i.dtype, tuple(i.shape)) for i in items]
    return [StoredTensor(p.key, p.dtype, p.shape, p) for p in parts]


def _parallel_wanted(model, items, parallel_write: bool | None, plugin, backend, target: Location) -> bool:
    """Whether to try the parallel write: ``True`` always, ``None`` with more than one rank; never
    (``True`` raises) for a format written by rank 0 only, a non-local ``target`` or quantized ties
    (it splits every tensor evenly)."""
    capable = plugin.CAPABILITIES.parallel_write
    if parallel_write and not capable:
        raise UsageError(f"parallel_write=True: the {plugin.NAME} format is written by rank 0 only; "
                         "pass parallel_write=None")
    if target.scheme is not None and capable:
        if parallel_write is True:
            raise UsageError(f"{target}: parallel_write=True writes regions of shared local files in place; "
                             "pass parallel_write=None or False for this storage")
        return False
    if any(i.tie is not None for i in items):
        if parallel_write:
            check_quantized_save(model, "with parallel_write=True")
        return False
    if parallel_write is None:
        return capable and backend is not None and backend.world_size > 1
    return parallel_write


__all__ = ["DistributedSave", "SafetensorsSave", "save", "save_options"]
