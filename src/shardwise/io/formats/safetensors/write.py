"""The plan of an ordinary safetensors checkpoint: which tensor goes to which file, in which
order, and the index. One recipe for every writer of such a checkpoint (``sw.save``'s rank-0
stream and parallel write, ``sw.consolidate`` of a DCP or a sharded safetensors checkpoint),
so that the same tensors give the same files, byte for byte, whichever wrote them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from shardwise.core.header import spec_nbytes
from shardwise.io.formats.safetensors.files import (
    INDEX_SUFFIX,
    StreamingWriter,
    header_metadata,
    index_json,
    plan_files,
    save_file_order,
)
from shardwise.io.sink import PlannedFile, Spec, StoredTensor, WritePlan


def plan_checkpoint(tensors: Sequence[Spec], *, max_shard_size: int | str, prefix: str,
                    metadata: Mapping[str, str] | None = None, index_metadata: Mapping | None = None,
                    storages: Mapping[str, tuple[object, int]] | None = None,
                    parts: Mapping | None = None) -> WritePlan:
    """The plan of a safetensors checkpoint of ``tensors`` (``(name, dtype, shape)``, in the
    model's order): split into files of at most ``max_shard_size`` as ``save_pretrained``
    splits (``plan_files``; ``storages`` as there), each file's tensors in ``save_file``'s
    order, every header's metadata ``{"format": "pt", **metadata}``, and, for more than one
    file, ``{prefix}.safetensors.index.json`` with ``total_size`` and ``metadata`` then
    ``index_metadata`` (``total_parameters``) in its metadata. ``parts`` (the hub layout's
    ``{stored name: StoredPart}``) travels with the plan. Pure; raises ``CheckpointError``
    for a bad size, prefix or metadata.

    >>> plan = plan_checkpoint([("b", "F16", (2,)), ("a", "F32", (2,))], max_shard_size="1GB", prefix="m")
    >>> [(f.name, [name for name, _, _ in f.tensors]) for f in plan.files], plan.index
    ([('m.safetensors', ['a', 'b'])], None)
    """
    header = header_metadata(metadata)
    files = tuple(PlannedFile(fname, tuple(sorted(group, key=save_file_order)))
                  for fname, group in plan_files(tensors, max_shard_size, prefix, storages))
    index = None
    if len(files) > 1:
        total = sum(spec_nbytes(dtype, shape) for _, dtype, shape in tensors)
        content = index_json([(f.name, f.tensors) for f in files], total,
                             {**dict(metadata or {}), **dict(index_metadata or {})})
        index = (prefix + INDEX_SUFFIX, content)
    return WritePlan(files, header, index, dict(parts or {}))


class SafetensorsSink:
    """The ordinary safetensors checkpoint's writer (a ``shardwise.io.sink.FileSink``),
    configured once: ``plan(stored)`` takes ``StoredTensor``\\ s and is the same on every
    rank; ``open_file`` streams one planned file (``StreamingWriter``)."""

    def __init__(self, *, max_shard_size: int | str, prefix: str, metadata: Mapping[str, str] | None,
                 index_metadata: Mapping | None = None,
                 storages: Mapping[str, tuple[object, int]] | None = None):
        self.max_shard_size, self.prefix = max_shard_size, prefix
        self.metadata, self.index_metadata, self.storages = metadata, index_metadata, storages

    def plan(self, stored: Sequence[StoredTensor]) -> WritePlan:
        return plan_checkpoint([s.spec for s in stored],
                               max_shard_size=self.max_shard_size, prefix=self.prefix,
                               metadata=self.metadata, index_metadata=self.index_metadata,
                               storages=self.storages,
                               parts={s.name: s.part for s in stored if s.part is not None})

    def open_file(self, location: Path, tensors: Sequence[Spec],
                  header: Mapping[str, str]) -> StreamingWriter:
        return StreamingWriter(location, tensors, header)


__all__ = ["SafetensorsSink", "plan_checkpoint"]
