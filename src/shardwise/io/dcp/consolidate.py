"""``sw.consolidate``: a distributed checkpoint to one ordinary safetensors checkpoint,
offline, in one process, without a process group.

The output is byte-identical to ``sw.save`` (the gather save) of the same model: the same
names in the same order, the same file split and naming, the same headers, index and
``shardwise.json`` (the checksums of the tensors as written). It is
streamed: each tensor is assembled from only its own chunks, written and freed, so memory
stays near one tensor. Every dtype works, integer and bool included. The files are written
aside and moved into place like ``sw.save``.

Each chunk's bytes are read straight into the tensor being assembled
(:func:`shardwise.io.dcp.chunks.read_chunk_into`, which checks each chunk against its zip
record's CRC-32 as torch.load does) rather than unpickled into a new tensor and copied, as
``dcp.load`` does; that copy was a third of the time. A checkpoint written
with storage transforms (DCP's experimental extensions) goes through ``dcp.load``.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from shardwise.core.header import dtype_to_str, str_to_dtype
from shardwise.core.spec import Region
from shardwise.errors import CheckpointError
from shardwise.io.dcp.chunks import MetadataReader, read_chunk_into
from shardwise.io.dcp.metadata import read_metadata
from shardwise.io.dcp.sharded import is_sharded_safetensors
from shardwise.io.dcp.sharded_read import consolidate_sharded
from shardwise.io.detect import METADATA_FILE
from shardwise.io.info import gather_info, read_info, user_metadata, write_info
from shardwise.io.safetensors.format import StreamingWriter
from shardwise.io.safetensors.hub_layout import model_from_folder
from shardwise.io.safetensors.hub_save import hub_save_layout, shared_storages
from shardwise.io.safetensors.sink import plan_checkpoint
from shardwise.io.side_files import copy_side_files
from shardwise.io.sink import WritePlan
from shardwise.io.target import Destination, target_path


def consolidation_plan(src, *, max_shard_size: int | str = "5GB", filename_prefix: str = "model",
                       layout: str = "hub", metadata: Metadata | None = None) -> WritePlan:
    """The ``WritePlan`` for consolidating ``src`` (whose DCP ``metadata`` is read unless
    given): the one ``sw.save`` makes for the same tensors (``plan_checkpoint``), in the hub
    layout (``plan.parts``) when ``src`` holds a transformers model's config.json and
    ``layout="hub"``, else in the module's own names."""
    src = Path(src)
    metadata = read_metadata(src) if metadata is None else metadata
    specs, other = [], []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            specs.append((fqn, dtype_to_str(md.properties.dtype), tuple(md.size)))
        else:
            other.append(fqn)
    if other:
        raise CheckpointError(f"{src}: entries {', '.join(other[:5])} are not tensors (an optimizer "
                              "checkpoint?); consolidate writes model checkpoints only")
    if not specs:
        raise CheckpointError(f"{src}: the checkpoint holds no tensors")
    user = user_metadata(src)
    parts, storages = _hub_parts(src, specs, layout)
    if parts:
        specs = [(p.key, p.dtype, p.shape) for p in parts.values()]
    recorded = dict((read_info(src) or {}).get("index_metadata") or {})  # total_parameters
    return plan_checkpoint(specs, max_shard_size=max_shard_size, prefix=filename_prefix, metadata=user,
                           index_metadata=recorded, storages=storages, parts=parts)


def _hub_parts(src: Path, specs: list, layout: str) -> tuple[dict, dict]:
    if layout not in ("hub", "module"):
        raise CheckpointError(f"layout must be 'hub' or 'module', got {layout!r}")
    model = model_from_folder(src) if layout == "hub" else None
    if model is None:
        if layout == "hub" and _names_transformers_model(src):
            raise CheckpointError(
                f"{src}/config.json names a transformers model, whose hub layout (the keys save_pretrained "
                "writes) only transformers can compute, and transformers is not installed here; install "
                "it, or pass layout='module' to write the model's own tensor names")
        return {}, {}
    parts = hub_save_layout(model, {n: (s, d) for n, d, s in specs}) or []
    sizes = {n: str_to_dtype(d).itemsize for n, d, _ in specs}
    return {p.key: p for p in parts}, shared_storages(parts, sizes)


def _names_transformers_model(src: Path) -> bool:
    """Whether ``src/config.json`` names a transformers architecture while transformers cannot
    be imported (then the hub layout is unknown, not absent)."""
    import json

    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not (isinstance(config, dict) and config.get("architectures") and "transformers_version" in config):
        return False
    try:
        import transformers  # noqa: F401
    except ImportError:
        return True
    return False


class _ChunkReader:
    """Whole tensors of one checkpoint, each from its own chunks; data files stay open."""

    def __init__(self, src: Path, metadata: Metadata):
        self.src, self.metadata = src, metadata
        self._files: dict[str, object] = {}

    def _file(self, rel: str):
        f = self._files.get(rel)
        if f is None:
            f = self._files[rel] = open(self.src / rel, "rb")  # noqa: SIM115 - closed by close()
        return f

    def tensor(self, name: str) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[name]
        infos = [self.metadata.storage_data[MetadataIndex(name, c.offsets)] for c in md.chunks]
        out = torch.empty(md.size, dtype=md.properties.dtype)
        if any(getattr(i, "transform_descriptors", None) for i in infos):
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({name: out}, storage_reader=MetadataReader(self.src, self.metadata), no_dist=True)
            return out
        for chunk, info in zip(md.chunks, infos, strict=True):
            box = out[Region(tuple(chunk.offsets), tuple(chunk.sizes)).slices()]
            read_chunk_into(self._file(str(info.relative_path)), info, (0,) * len(chunk.sizes),
                            tuple(chunk.sizes), box, dtype=md.properties.dtype, sizes=tuple(chunk.sizes))
        return out

    def part(self, part, parts: dict) -> torch.Tensor:
        """A tensor of the hub layout, assembled from boxes of model tensors; each model
        tensor is read once and kept until its last box is written."""
        held = self.__dict__.setdefault("_held", {})
        uses = self.__dict__.setdefault("_uses", Counter(n for p in parts.values() for n, _ in p.fragments))

        def tensor(name: str) -> torch.Tensor:
            if name not in held:
                held[name] = self.tensor(name)
            full = held[name]
            uses[name] -= 1
            if uses[name] == 0:
                del held[name]
            return full

        return part.assemble(tensor)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def consolidate(src: str | os.PathLike, dst: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                filename_prefix: str = "model", overwrite: bool = False, layout: str = "hub") -> Path:
    """Write the distributed checkpoint ``src`` as a safetensors checkpoint in the folder
    ``dst``; one process, no process group. Returns ``dst``.

    ``max_shard_size`` and ``filename_prefix`` split and name the files as ``sw.save`` does
    (``{prefix}.safetensors``, or ``{prefix}-0000i-of-0000N.safetensors`` plus an index).
    ``dst`` must not exist unless ``overwrite=True``. A transformers model's checkpoint (its
    config.json beside the data) is written in its hub layout, as ``save_pretrained`` and
    ``sw.save`` write it; ``layout="module"`` keeps the module's own names. ``src``'s
    ``.metadata`` is a pickle: consolidate only checkpoints whose source you trust.

    >>> sw.consolidate("out/dcp", "out/merged", max_shard_size="2GB")   # doctest: +SKIP
    """
    if is_sharded_safetensors(src):  # torch's / transformers' rank-local safetensors: no pickle
        return consolidate_sharded(src, dst, max_shard_size=max_shard_size,
                                   filename_prefix=filename_prefix, overwrite=overwrite)
    _refuse_plain_safetensors(Path(src))
    metadata = read_metadata(Path(src))
    plan = consolidation_plan(src, max_shard_size=max_shard_size, filename_prefix=filename_prefix,
                              layout=layout, metadata=metadata)
    parts = plan.parts
    reader = _ChunkReader(Path(src), metadata)
    dest = Destination(target_path(dst), overwrite)
    # The copies are memory-bound: one thread moves them as fast, while a pool of OpenMP
    # threads waiting on each other was up to 10x slower on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dest.prepare()
        checksums: dict[str, str] = {}
        for planned in plan.files:
            with StreamingWriter(dest.tmp / planned.name, planned.tensors, metadata=plan.header) as writer:
                for name, _, _ in planned.tensors:
                    part = parts.get(name)
                    writer.write(name, reader.tensor(name) if part is None else reader.part(part, parts))
            checksums.update(writer.checksums)
        write_info(dest.tmp, gather_info(checksums, plan.tensors))
        copy_side_files(Path(src), dest.tmp)  # a Hugging Face model's config.json & co
        dest.commit(plan.index)
    finally:
        torch.set_num_threads(threads)
        reader.close()
        dest.discard()
    return dest.target


def _refuse_plain_safetensors(src: Path) -> None:
    """An ordinary safetensors checkpoint (no DCP ``.metadata``) has nothing to consolidate."""
    if (src / METADATA_FILE).is_file():
        return
    files = [src] if src.suffix == ".safetensors" and src.is_file() else (
        sorted(src.glob("*.safetensors")) if src.is_dir() else [])
    if files:
        raise CheckpointError(
            f"{src} is already a safetensors checkpoint ({len(files)} .safetensors file(s), no DCP "
            ".metadata): consolidate turns a distributed checkpoint into one, so there is nothing to "
            "do; load or copy it as it is (sw.load, from_pretrained), or `shardwise inspect` it")


__all__ = ["consolidate", "consolidation_plan"]
