"""A distributed checkpoint's metadata, read safely and checked for completeness.

DCP's ``.metadata`` is a pickle. It is unpickled here with an allow-list of the classes a
DCP metadata file holds (so a planted file cannot run code while being read), but a
checkpoint is still only as trustworthy as its source. A save writes ``.metadata`` last,
so its absence, or a data file it lists that is missing or short, means the save never
finished: "incomplete checkpoint".
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from shardwise.errors import CheckpointError
from shardwise.io.safetensors_io import byte_view

METADATA_FILE = ".metadata"

_META_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    # DCP writes .metadata with pickle; only the classes such a file holds may be built,
    # so a planted file cannot name os.system or similar.
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _META_MODULE:
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        raise CheckpointError(
            f"the DCP .metadata names {module}.{name}, which a DCP metadata file never needs; "
            "refusing to unpickle it (the file was not written by torch.distributed.checkpoint, "
            "or was tampered with)")


def read_metadata(path: str | Path) -> Metadata:
    """The DCP ``Metadata`` of the checkpoint folder ``path``, after checking it is complete.

    Raises ``CheckpointError`` ("incomplete checkpoint") when ``.metadata`` is missing or
    unreadable, or when a data file it names is missing or shorter than the bytes it lists.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    meta = path / METADATA_FILE
    if not meta.is_file():
        from shardwise.io.target import TMP_MARK

        partial = sorted(p.name for p in path.parent.glob(f".{path.name}{TMP_MARK}*"))
        hint = f" ({partial[0]} beside it is an unfinished save)" if partial else ""
        raise CheckpointError(
            f"{path}: incomplete checkpoint: no {METADATA_FILE}{hint}. A DCP save writes it last, "
            "so the save that wrote this folder never finished (or this is not a DCP checkpoint); "
            "save again or load an earlier checkpoint")
    try:
        with open(meta, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except CheckpointError as e:
        raise CheckpointError(f"{meta}: {e}") from e
    except Exception as e:
        raise CheckpointError(f"{meta}: incomplete checkpoint: the metadata cannot be read ({e})") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{meta}: not a DCP metadata file ({type(metadata).__name__})")
    _check_files(path, metadata)
    return metadata


def _check_files(path: Path, metadata: Metadata) -> None:
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        rel = str(info.relative_path)
        if not rel or "/" in rel or "\\" in rel or rel in (".", ".."):
            raise CheckpointError(f"{path}: the metadata names data file {rel!r}, outside the folder")
        need[rel] = max(need.get(rel, 0), info.offset + info.length)
    bad = []
    for rel, size in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            bad.append(f"{rel} is missing")
        elif f.stat().st_size < size:
            bad.append(f"{rel} has {f.stat().st_size} bytes, fewer than the {size} listed")
    if bad:
        raise CheckpointError(f"{path}: incomplete checkpoint: {'; '.join(bad[:5])}"
                              f"{' ...' if len(bad) > 5 else ''}; save again or load an earlier checkpoint")
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            volume = sum(math.prod(c.sizes) for c in md.chunks)
            if volume != math.prod(md.size):
                raise CheckpointError(f"{path}: tensor {fqn!r} of shape {tuple(md.size)} is not covered "
                                      f"by its chunks ({volume} of {math.prod(md.size)} elements)")


def read_chunk_into(f, info, offsets, lengths, dest: torch.Tensor) -> int:
    """Copy the box (``offsets``, ``lengths``) of the saved chunk ``info`` (a DCP
    ``_StorageInfo``: a torch.save blob at ``info.offset`` in the open file ``f``) into
    ``dest``; return the bytes read from the file.

    DCP's reader unpickles every saved chunk whole into a new tensor and then copies the
    part it needs: under resharding each rank holds a transient copy of chunks bigger than
    its share, and the allocator keeps that memory. Here the blob is opened on the meta
    device (``weights_only``: its layout and where its bytes start, no data read), and only
    the byte runs of the box are read, straight into ``dest`` when it is contiguous on the
    CPU in the saved dtype (else through a buffer the size of the box). A chunk stored in a
    layout other than a plain contiguous one is read whole, as DCP does.
    """
    from torch.distributed.checkpoint.utils import _create_file_view

    from shardwise.core.header import region_runs
    from shardwise.io.safetensors_io import _pread_into

    where = f"{getattr(f, 'name', '?')}: a chunk at byte {info.offset}"
    try:
        meta = torch.load(_create_file_view(f, info.offset, info.length), map_location="meta",
                          weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{where} cannot be read ({e})") from e
    record = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    if record is None or not meta.is_contiguous():
        whole = torch.load(_create_file_view(f, info.offset, info.length), map_location="cpu",
                           weights_only=True)
        dest.copy_(whole[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))])
        return info.length
    if tuple(dest.shape) != tuple(lengths):
        raise CheckpointError(f"{where} gives a {tuple(lengths)} box for a {tuple(dest.shape)} destination")
    direct = dest.is_contiguous() and dest.dtype == meta.dtype and dest.device.type == "cpu"
    out = dest if direct else torch.empty(tuple(lengths), dtype=meta.dtype)
    base = info.offset + record + meta.storage_offset() * meta.element_size()
    runs = region_runs(tuple(meta.shape), meta.element_size(), tuple(offsets), tuple(lengths))
    buf = byte_view(out.detach())
    pos = 0
    for start, length in runs:
        _pread_into(f.fileno(), buf[pos:pos + length], base + start, what=where)
        pos += length
    if not direct:
        dest.copy_(out)
    return pos


class MetadataReader(FileSystemReader):
    """A ``FileSystemReader`` that serves metadata already read (and checked) by
    :func:`read_metadata` instead of unpickling ``.metadata`` again, and that reads only
    the bytes each rank needs (:func:`read_chunk_into`) straight into its tensors.
    ``bytes_read`` counts them. Storage transforms (DCP's experimental extensions) go
    through DCP's own reader.
    """

    def __init__(self, path: str | Path, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata
        self.bytes_read = 0

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self._metadata

    def read_data(self, plan, planner):
        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.distributed.checkpoint.utils import _create_file_view

        infos = {item.storage_index: self.storage_data[item.storage_index] for item in plan.items}
        if any(getattr(i, "transform_descriptors", None) for i in infos.values()):
            self.bytes_read += sum(i.length for i in infos.values())
            return super().read_data(plan, planner)
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(str(infos[item.storage_index].relative_path), []).append(item)
        for rel, items in by_file.items():
            with open(Path(self.path) / rel, "rb") as f:
                for item in items:
                    info = infos[item.storage_index]
                    if item.type == LoadItemType.BYTE_IO:
                        data = _create_file_view(f, info.offset, info.length).read()
                        self.bytes_read += len(data)
                        planner.load_bytes(item, io.BytesIO(data))
                        continue
                    target = planner.resolve_tensor(item).detach()
                    self.bytes_read += read_chunk_into(f, info, item.storage_offsets, item.lengths, target)
                    planner.commit_tensor(item, target)
        done = torch.futures.Future()
        done.set_result(None)
        return done


def check_tensors(path, metadata: Metadata, wanted: Mapping[str, tuple[int, ...]], *,
                  strict: bool, allowed_extra=()) -> tuple[list[str], list[str]]:
    """Compare the checkpoint's tensors with ``wanted`` ({key: canonical shape}); return the
    missing and the unexpected keys.

    Raises ``CheckpointError`` naming the keys for shape or kind mismatches and, with
    ``strict``, for missing or unexpected keys.
    """
    md = metadata.state_dict_metadata
    missing = [k for k in wanted if k not in md]
    if missing and strict:
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing from the checkpoint: "
                              f"{_listing([repr(k) for k in missing])}; load the checkpoint that "
                              "matches this model, or pass strict=False to keep the model's values")
    wrong = []
    for k, shape in wanted.items():
        m = md.get(k)
        if m is None:
            continue
        if not isinstance(m, TensorStorageMetadata):
            wrong.append(f"{k!r} is not a tensor in the checkpoint")
        elif tuple(m.size) != tuple(shape):
            wrong.append(f"{k!r} is {tuple(m.size)} in the checkpoint but {tuple(shape)} in the model")
    if wrong:
        raise CheckpointError(f"{path}: {len(wrong)} tensor(s) do not match the model: "
                              f"{_listing(wrong)}; load a checkpoint of this model's configuration")
    allowed = set(allowed_extra)
    extra = [k for k in md if k not in wanted and k not in allowed]
    if extra and strict:
        raise CheckpointError(f"{path}: {len(extra)} checkpoint tensor(s) have no place in the model: "
                              f"{_listing([repr(k) for k in extra])}; pass strict=False to ignore them")
    return missing, extra


def _listing(names, show: int = 20) -> str:
    shown = ", ".join(names[:show])
    return shown + (f", ... and {len(names) - show} more" if len(names) > show else "")
