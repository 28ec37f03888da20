"""``sw.save``: options -> plan -> transaction -> writer, for every format the registry writes.

:func:`save_options` decodes the keyword arguments once into ``SafetensorsSave`` (a gathered
format) or ``DistributedSave`` (every rank writes its own part), the format named by the
registry; an argument of the other kind is refused there. The gather save: every rank plans
the files from the shard specs (pure, the same everywhere) before any tensor moves; the stream
gathers one tensor at a time to rank 0, which writes it in its canonical layout (or, where the
format can and the folder is shared, every rank writes its own regions). Each save is one
``shardwise.io.sink.Saving``: complete or absent.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardwise._progress import Progress
from shardwise.backends import Backend
from shardwise.comm import fingerprint
from shardwise.core.adapter import adapter_for
from shardwise.errors import CheckpointError, CollectiveError, UsageError
from shardwise.io import parallel_save
from shardwise.io.check.against import Expectation, compare, expected_tensors
from shardwise.io.formats import get_format, save_format
from shardwise.io.formats.safetensors.files import parse_size
from shardwise.io.gather import StreamSink, collect_items
from shardwise.io.guards import check_model
from shardwise.io.info import gather_info
from shardwise.io.quant_checks import check_quantized_save
from shardwise.io.sink import Saving, StoredTensor
from shardwise.io.storage.transaction import target_path
from shardwise.mesh import world_backend

if TYPE_CHECKING:
    from shardwise.io.formats.dcp.checkpoint import AsyncSave

# --- sw.save's keyword arguments, decoded once at the door: one frozen options value per kind of
# save; an argument that does not apply to the kind asked for is refused, naming it ---

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



def save(model: nn.Module, path: str | os.PathLike, *, max_shard_size: int | str = "5GB",
         filename_prefix: str | None = None, metadata: Mapping[str, str] | None = None,
         overwrite: bool = False, progress: bool | None = None, distributed: bool = False,
         async_save: bool = False, format: str | None = None, layout: str = "hub",
         parallel_write: bool | None = None) -> AsyncSave | None:
    """Write ``model`` to the folder ``path`` as an ordinary safetensors checkpoint.

    Collective: every rank calls it (a rank that waits over a minute for the others raises,
    saying so), rank 0 writes. The folder holds
    ``{filename_prefix}.safetensors``, or ``{prefix}-0000i-of-0000N.safetensors`` files of
    at most ``max_shard_size`` each (split where huggingface_hub's
    ``split_torch_state_dict_into_shards`` splits) plus ``{prefix}.safetensors.index.json``,
    whose metadata has ``total_size`` and, unless the model is a diffusers one,
    ``total_parameters``; the prefix defaults to ``diffusion_pytorch_model`` for a diffusers
    model, else ``model``. A transformers or diffusers model's ``config.json`` (and
    ``generation_config.json``) is written too, as its ``save_pretrained`` writes it, so the
    library's ``from_pretrained`` loads the folder; given the same ``max_shard_size``, the
    files are byte-identical to ``save_pretrained``'s. Every header
    has ``{"format": "pt"}`` and ``metadata`` (which also goes into the index). Tensors are
    canonical (unsharded, packed blocks in their own order) and tied weights are written
    once, under the name kept by the plan. ``layout="hub"`` (the default) writes a
    transformers model in the layout ``save_pretrained`` writes (per-expert tensors,
    original names: transformers' weight conversions reverted, as region maps);
    ``layout="module"`` writes the module's own names. A model that was not parallelised is written as
    it is by rank 0 (a world of one, or ranks holding identical copies). ``shardwise.json``
    beside them records each tensor's checksum (XXH3-64), computed as it is written, which
    ``sw.verify`` checks.

    ``parallel_write``: with ranks on several machines that all see the target's filesystem
    (None, the default, probes it: rank 0 puts a token in the temporary folder and every rank
    reads it), nothing is gathered: rank 0 lays every file out and each rank writes its own
    regions at their offsets (``shardwise.io.parallel_save``); the checksums are then read
    back from the files. Same bytes, same crash safety. On one machine None streams from
    rank 0 (several writers sharing one disk and page cache were measured no faster);
    ``True`` writes in parallel wherever the folder is shared and raises when a rank cannot
    see it; ``False`` always streams.

    Memory (the rank-0 stream): rank 0 builds one tensor at a time, in one reused buffer,
    from row chunks of every rank's shard gathered in turn (about an eighth of the tensor
    each), so its peak above its baseline stays under 2x the largest tensor (1.25-1.5x
    measured); other ranks only send their shards and never hold a full tensor. Writing in
    parallel, no rank holds more than a copy of one box of its own shard (8 MiB more to
    read the checksums back).
    ``progress`` shows a tqdm bar on rank 0 (default: when stderr is a terminal).
    ``format`` names the format the registry writes (``shardwise.io.formats``; None: the
    default of the kind of save). ``distributed=True`` writes a distributed checkpoint
    instead, every rank its own part: torch DCP (``format="dcp"``, the default, also spelled
    ``"distcp"``); ``max_shard_size``, ``filename_prefix``, ``layout`` and ``parallel_write``
    do not apply and are refused; with ``async_save=True`` too it returns a handle whose
    ``wait()`` every rank calls. ``format="sharded"`` (also spelled ``"safetensors"`` with
    ``distributed=True``) writes rank-local safetensors files instead (torch's
    ``HuggingFaceStorageWriter(save_distributed=True)`` format, which transformers and torch
    read; no pickle; no ``async_save``). A format registered with a gathered writer is written
    as the gather save writes safetensors (``format=NAME``). The gather save returns None.

    FP8 models (transformers' ``FP8Linear`` modules, kept quantized by ``sw.load``): the fp8
    weights and float32 ``weight_scale_inv`` scales are written as stored, each scale once
    (from the rank holding its block's first row), with the config's ``quantization_config``:
    a checkpoint loaded at any degree saves back byte for byte. The distributed and parallel
    writes refuse them for now.

    Crash safety: everything is written into ``.{name}.shardwise-tmp-*`` beside ``path``
    (same filesystem) and renamed into place when complete; a folder already at ``path``
    is an error unless ``overwrite=True`` (an empty folder counts as absent), and is then
    exchanged for the new one in one atomic rename (Linux ``renameat2``; elsewhere renamed
    aside first, a window that the next save repairs) and only then deleted. ``overwrite``
    refuses a folder holding anything but checkpoint files and their ``config.json`` /
    ``generation_config.json``, so that it never deletes, say, a tokenizer. If a rank dies
    or any rank fails: ``path`` is untouched (absent, or the previous checkpoint byte for
    byte), every surviving rank raises, and rank 0 removes its temporary folder; one left
    by a killed rank 0 is removed by the next save to ``path``. A temporary folder never
    sits at a path a loader would look at, its files appear only once fsynced, and a
    several-file checkpoint gets its index last.

    >>> sw.save(model, "out/full", max_shard_size="2GB")                    # doctest: +SKIP
    >>> sw.load(model2, "out/full", plan=plan, mesh=backend.mesh(tp=2))     # doctest: +SKIP
    """
    options = save_options(distributed=distributed, max_shard_size=max_shard_size,
                           filename_prefix=filename_prefix, layout=layout, parallel_write=parallel_write,
                           format=format, async_save=async_save)
    backend = world_backend()  # the API boundary: the backend of every collective of the save
    check_model(model, action="save")
    plugin = get_format(options.format)
    if not plugin.CAPABILITIES.quantized:
        check_quantized_save(model, f"as {plugin.CAPABILITIES.label} (format={format!r})")
    if isinstance(options, DistributedSave):
        join_collective(backend, "sw.save")
        return plugin.save(model, path, backend=backend, overwrite=overwrite, metadata=metadata,
                           progress=progress, async_save=options.async_save)
    save_gathered(model, path, options, plugin, backend=backend, metadata=metadata, overwrite=overwrite,
                  progress=progress)
    return None


def save_gathered(model: nn.Module, path, options: SafetensorsSave, plugin, *, backend: Backend | None,
                  metadata, overwrite: bool, progress: bool | None) -> None:
    """``sw.save(..., distributed=False)`` with its decoded ``options`` and its gathered
    format's ``plugin``: plan every file (pure, the same on every rank), meet, then write
    through the rank-0 stream or, where every rank sees the folder and the format can, the
    parallel write; move the folder into place when every rank is done. ``backend``
    (``shardwise.mesh.world_backend``) runs the collectives."""
    target = target_path(path)
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
    stream = StreamSink(backend, state, {i.name: i for i in items}, what=what, sink=writer)
    plan = stream.plan(stored)
    parallel = plugin.CAPABILITIES.parallel_write and parallel_save.wanted(options.parallel_write, backend)
    if options.parallel_write and not plugin.CAPABILITIES.parallel_write:
        raise UsageError(f"parallel_write=True: the {plugin.NAME} format is written by rank 0 only; "
                         "pass parallel_write=None")
    if any(i.tie is not None for i in items):  # the parallel write splits every tensor evenly
        if options.parallel_write:
            check_quantized_save(model, "with parallel_write=True")
        parallel = False
    join_collective(backend, "sw.save")  # after the guards and the plan: all pure
    digest = fingerprint((plan.files, [(i.name, i.spec, i.degree) for i in items], options.parallel_write))
    with Saving(target, overwrite=overwrite, backend=backend, what=what, digest=digest) as saving:
        folder = saving.folder if saving.rank0 else None
        shared = (parallel_save.shared_folder(backend, folder, what=what,
                                              required=options.parallel_write is True) if parallel else None)
        sink = stream if shared is None else parallel_save.ParallelSink(
            backend, state, stream.items, what=what, sink=writer)
        with Progress(sum(i.nbytes for i in items), progress, stream.rank == 0, "shardwise save") as bar:
            checksums = sink.write(plan, shared or folder, bar)
        info = gather_info(checksums, [s.spec for s in stored]) if saving.rank0 else None
        # config.json & co beside the data: from_pretrained reads the folder
        saving.commit(info=info, side_files=lambda folder: adapter.write_side_files(model, folder),
                      index=plan.index)


# How long the first rank to enter a save waits for the others before saying that the call
# must be made on every rank (bounded by the backend's timeout).
HANDSHAKE_SECONDS = 60.0


def join_collective(backend: Backend | None, what: str) -> None:
    """Every rank meets here first: a rank that enters ``what`` alone (under ``if rank ==
    0:``) gets an error naming the mistake within HANDSHAKE_SECONDS, rather than a gloo
    "Connection closed by peer" or a hang in the middle of the save."""
    if backend is None or backend.world_size == 1:
        return
    seconds = min(HANDSHAKE_SECONDS, backend.timeout.total_seconds())
    # A tag rather than a barrier: a peer waiting in another collective of the same shape
    # (a barrier at its exit) must not pass for a peer entering the save.
    # uint8, as agree()'s rows: every backend gathers bytes.
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
    """The save's invariant, before anything is written: every stored tensor has exactly the
    name, shape and dtype that a checkpoint of ``model`` holds in ``layout`` (what
    ``sw.verify(path, against=model)`` checks afterwards), else ``CheckpointError``."""
    tensors = {i.name: (tuple(i.shape), i.dtype) for i in items}
    want = Expectation(type(model).__name__, layout, expected_tensors(model, layout=layout, tensors=tensors),
                       {}, True)
    report = compare({s.name: (s.dtype, s.shape) for s in stored}, want)
    if not report.ok:
        raise CheckpointError(f"sw.save would write a checkpoint that does not match {type(model).__name__} "
                              f"({layout} layout): {'; '.join(report.problems()[:5])}. Nothing was written; "
                              "save with layout='module', and report this as a bug")


def stored_tensors(model: nn.Module, items, layout: str) -> list[StoredTensor]:
    """Every tensor the save writes (name, dtype, shape, StoredPart or None), in order:
    the model's own tensors (``layout="module"``, or a model without weight conversions), or
    the hub layout ``save_pretrained`` writes (``layout="hub"``: per-expert tensors, original
    names), each a box of a model tensor."""
    if layout not in ("hub", "module"):
        raise CheckpointError(f"layout must be 'hub' or 'module', got {layout!r}")
    parts = (adapter_for(model).save_layout(model, {i.name: (i.shape, i.dtype) for i in items})
             if layout == "hub" else None)
    if parts is None:
        return [StoredTensor(i.name, i.dtype, tuple(i.shape)) for i in items]
    return [StoredTensor(p.key, p.dtype, p.shape, p) for p in parts]


__all__ = ["DistributedSave", "SafetensorsSave", "save", "save_options"]
