"""``sw.save``: gather a tensor-parallel model into an ordinary safetensors checkpoint.

Every rank calls it; rank 0 writes. Names, dtypes and canonical shapes come from the shard
specs, so rank 0 plans the files and writes each header before any tensor arrives; then one
tensor at a time is gathered to rank 0, put back in its canonical layout (packed blocks in
their unsharded order), written and freed. Replicated tensors are written from rank 0's copy.

What an interrupted save leaves (see :func:`save` for the full statement): the files go into a
temporary folder beside the target, ``.{name}.shardwise-tmp-{host}-{pid}-{token}``, which
is moved into place with one rename once it is complete, so the target is always either
absent, the previous checkpoint, or the new one whole.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch import nn

from shardwise._progress import Progress
from shardwise.errors import CheckpointError
from shardwise.io.gather import (
    FileGatherer,
    agree,
    capture,
    collect_items,
    fingerprint,
    world_backend,
)
from shardwise.io.safetensors_io import INDEX_SUFFIX, index_json, plan_files
from shardwise.io.target import Destination, target_path

if TYPE_CHECKING:
    from shardwise.io.dcp import AsyncSave

# safetensors' serializer orders a file's tensors by dtype (its enum order, descending),
# then by name; we follow it so that a one-file save of a model is byte-identical to
# save_file(state_dict, metadata={"format": "pt"}).
_SAVE_FILE_DTYPES = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16",
                     "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")


def save(model: nn.Module, path: str | os.PathLike, *, max_shard_size: int | str = "5GB",
         filename_prefix: str = "model", metadata: Mapping[str, str] | None = None,
         overwrite: bool = False, progress: bool | None = None, distributed: bool = False,
         async_save: bool = False) -> AsyncSave | None:
    """Write ``model`` to the folder ``path`` as an ordinary safetensors checkpoint.

    Collective: every rank calls it, rank 0 writes. The folder holds
    ``{filename_prefix}.safetensors``, or ``{prefix}-0000i-of-0000N.safetensors`` files of
    at most ``max_shard_size`` each plus ``{prefix}.safetensors.index.json``; every header
    has ``{"format": "pt"}`` and ``metadata`` (which also goes into the index). Tensors are
    canonical (unsharded, packed blocks in their own order) and tied weights are written
    once, under the name kept by the plan. A model that was not parallelised is written as
    it is by rank 0 (a world of one, or ranks holding identical copies).

    Memory: rank 0 builds one tensor at a time, in one reused buffer, from row chunks of
    every rank's shard gathered in turn (about an eighth of the tensor each), so its peak
    above its baseline stays under 2x the largest tensor (1.25-1.5x measured); other ranks
    only send their shards and never hold a full tensor.
    ``progress`` shows a bar on rank 0 (default: when stderr is a terminal; tqdm if
    installed). ``distributed=True`` writes a torch distributed checkpoint instead, every
    rank its own part (``shardwise.io.dcp.save_dcp``; ``max_shard_size`` and
    ``filename_prefix`` do not apply); with ``async_save=True`` too it returns a handle
    whose ``wait()`` every rank calls. The gather save returns None.

    Crash safety: everything is written into ``.{name}.shardwise-tmp-*`` beside ``path``
    (same filesystem) and renamed into place when complete; a folder already at ``path``
    is an error unless ``overwrite=True`` (an empty folder counts as absent), and is then
    exchanged for the new one in one atomic rename (Linux ``renameat2``; elsewhere renamed
    aside first, a window that the next save repairs) and only then deleted. ``overwrite``
    refuses a folder holding anything but checkpoint files, so that it never deletes, say,
    a ``config.json``. If a rank dies or any rank fails: ``path`` is untouched (absent, or
    the previous checkpoint byte for byte), every surviving rank raises, and rank 0 removes
    its temporary folder; one left by a killed rank 0 is removed by the next save to
    ``path``. A temporary folder never sits at a path a loader would look at, its files
    appear only once fsynced, and a several-file checkpoint gets its index last.

    >>> sw.save(model, "out/full", max_shard_size="2GB")                    # doctest: +SKIP
    >>> sw.load(model2, "out/full", plan=plan, mesh=backend.mesh(tp=2))     # doctest: +SKIP
    """
    if async_save and not distributed:
        raise ValueError("async_save=True writes a distributed checkpoint; pass distributed=True too")
    if distributed:
        return _save_dcp(model, path, overwrite=overwrite, metadata=metadata, progress=progress,
                         async_save=async_save)
    from shardwise.io.guards import check_model

    check_model(model, action="save")
    target = target_path(path)
    header_meta = header_metadata(metadata)
    items, state = collect_items(model)
    file_plan = [(fname, sorted(group, key=save_file_order)) for fname, group in
                 plan_files([(i.name, i.dtype, i.shape) for i in items], max_shard_size, filename_prefix)]
    backend = world_backend()
    run = FileGatherer(backend, state, {i.name: i for i in items}, header_meta)
    what = f"sw.save to {target}"
    dest = Destination(target, overwrite) if run.rank == 0 else None
    index = None
    if len(file_plan) > 1:
        index = (filename_prefix + INDEX_SUFFIX,
                 index_json(file_plan, sum(i.nbytes for i in items), dict(metadata or {})))
    try:
        agree(backend, capture(dest.prepare) if dest else None, what=what,
              digest=fingerprint((file_plan, [(i.name, i.spec, i.degree) for i in items])))
        with Progress(sum(i.nbytes for i in items), progress, run.rank == 0, "shardwise save") as bar:
            for fname, group in file_plan:
                bar.file(fname)
                error = run.write_file(dest.tmp / fname if dest else None, group, bar)
                agree(backend, error, what=what)
        agree(backend, capture(lambda: dest.commit(index)) if dest else None, what=what)
    finally:
        if dest is not None:
            dest.discard()


def _save_dcp(model, path, **kwargs):
    try:
        from shardwise.io.dcp import save_dcp
    except ImportError as e:
        raise ImportError(f"sw.save(..., distributed=True) needs shardwise.io.dcp, which cannot be "
                          f"imported here ({e}); save without distributed=True for a safetensors "
                          "checkpoint") from e
    return save_dcp(model, path, **kwargs)


def header_metadata(metadata) -> dict[str, str]:
    metadata = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"metadata must map strings to strings, got {metadata!r:.200}")
    if metadata.get("format", "pt") != "pt":
        raise CheckpointError(f"metadata['format'] is {metadata['format']!r}; a torch safetensors "
                              "checkpoint says 'pt' there, which loaders check; drop the key")
    return {"format": "pt", **metadata}


def save_file_order(spec) -> tuple[int, str]:
    name, dtype, _ = spec
    rank = _SAVE_FILE_DTYPES.index(dtype) if dtype in _SAVE_FILE_DTYPES else len(_SAVE_FILE_DTYPES)
    return rank, name


__all__ = ["header_metadata", "save", "save_file_order"]
