"""What every safetensors checkpoint shardwise writes (``sw.save``, ``sw.consolidate``, the
sharded safetensors save) puts in its headers, and in what order a file lists its tensors,
so that all of them write the same bytes for the same tensors. Imports no format module.
"""

from __future__ import annotations

from shardwise.errors import CheckpointError

# safetensors' serializer orders a file's tensors by dtype (its enum order, descending),
# then by name; we follow it so that a one-file save of a model is byte-identical to
# save_file(state_dict, metadata={"format": "pt"}).
_SAVE_FILE_DTYPES = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16",
                     "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")


def header_metadata(metadata) -> dict[str, str]:
    """The ``__metadata__`` of every header: ``{"format": "pt"}`` and the user's ``metadata``
    (strings to strings, else ``CheckpointError``)."""
    metadata = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"metadata must map strings to strings, got {metadata!r:.200}")
    if metadata.get("format", "pt") != "pt":
        raise CheckpointError(f"metadata['format'] is {metadata['format']!r}; a torch safetensors "
                              "checkpoint says 'pt' there, which loaders check; drop the key")
    return {"format": "pt", **metadata}


def save_file_order(spec) -> tuple[int, str]:
    """The sort key of a ``(name, dtype, shape)`` within one file: ``save_file``'s order."""
    name, dtype, _ = spec
    rank = _SAVE_FILE_DTYPES.index(dtype) if dtype in _SAVE_FILE_DTYPES else len(_SAVE_FILE_DTYPES)
    return rank, name


__all__ = ["header_metadata", "save_file_order"]
