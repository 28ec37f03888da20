"""The safetensors header (pure): dtype names, parsing (every field of an untrusted header is
checked before use), layout, byte runs, and the tiling check of a stored tensor's chunks."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from shardwise.core.spec import Region, is_int, overlapping
from shardwise.errors import CheckpointError, UsageError

# The reference reader refuses headers above 100 MB; so do we, before allocating.
MAX_HEADER_SIZE = 100_000_000

_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool", "C64": "complex64",
    "U64": "uint64", "U32": "uint32", "U16": "uint16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    # safetensors 0.8 (MXFP4 checkpoints): E8M0 block scales, and FP4 values two a byte
    "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2",
}
# The torch release that brought each dtype added after torch 2.6 (this package's floor).
_SINCE = {"F8_E8M0": "2.7", "F4": "2.8"}
# Values a stored element packs along the last dim: a safetensors F4 header counts FP4 values,
# torch's float4_e2m1fn_x2 (and every region here) counts bytes, two values each. Only these two
# places convert: parse_header (file to torch) and layout_header (torch to file).
_PACKED = {"F4": 2}
# Only the dtypes this torch has: a file naming another one is refused as unknown.
_STR_TO_DTYPE: dict[str, torch.dtype] = {
    s: getattr(torch, t) for s, t in _DTYPE_NAMES.items() if hasattr(torch, t)
}
_DTYPE_TO_STR = {d: s for s, d in _STR_TO_DTYPE.items()}

Spec = tuple[str, str, tuple[int, ...]]


def dtype_to_str(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype: ``dtype_to_str(torch.bfloat16) == "BF16"``."""
    try:
        return _DTYPE_TO_STR[dtype]
    except KeyError:
        raise CheckpointError(
            f"dtype {dtype} has no safetensors name; supported: {sorted(map(str, _DTYPE_TO_STR))}"
        ) from None


def str_to_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name: ``str_to_dtype("F32") is torch.float32``."""
    try:
        return _STR_TO_DTYPE[name]
    except (KeyError, TypeError):
        raise CheckpointError(_unknown_dtype(name, "unknown safetensors dtype")) from None


def _unknown_dtype(name: object, unknown: str = "unknown dtype") -> str:
    if isinstance(name, str) and name in _SINCE:
        return (f"safetensors dtype {name!r} (torch.{_DTYPE_NAMES[name]}) needs torch >= "
                f"{_SINCE[name]}; this is torch {torch.__version__}: upgrade torch to read it")
    return f"{unknown} {name!r}; known: {sorted(_STR_TO_DTYPE)}"


def stored_shape(dtype: str, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape a safetensors header writes for a tensor of torch ``shape``: the same but for
    F4, whose header counts FP4 values, two a byte: ``stored_shape("F4", (4, 6)) == (4, 12)``."""
    pack = _PACKED.get(dtype, 1)
    if pack == 1:
        return tuple(shape)
    if not shape:
        raise CheckpointError(f"a scalar of {dtype} has no last dim to pack {pack} values a byte along")
    return (*shape[:-1], shape[-1] * pack)


def torch_shape(dtype: str, stored: Sequence[int], *, where: str) -> tuple[int, ...]:
    """The torch shape of a header's ``stored`` shape (the inverse of ``stored_shape``); an F4
    tensor whose last dim is odd has no torch form (a byte would hold values of two rows):
    ``CheckpointError`` naming the fix."""
    pack = _PACKED.get(dtype, 1)
    if pack == 1:
        return tuple(stored)
    if not stored or stored[-1] % pack:
        raise CheckpointError(
            f"{where}: {dtype} shape {list(stored)} has a last dim that is not a multiple of {pack}, so "
            f"torch.{_DTYPE_NAMES[dtype]} (bytes of {pack} values along the last dim) cannot hold it "
            f"exactly; save it with an even last dim, or as U8 bytes with the shape you pack them in")
    return (*stored[:-1], stored[-1] // pack)


def spec_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of safetensors dtype ``dtype`` and ``shape``."""
    return math.prod(shape) * str_to_dtype(dtype).itemsize


class NamedDtype:
    """``torch_dtype`` and ``itemsize`` of a record whose ``dtype`` is a safetensors name."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return str_to_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize


@dataclass(frozen=True)
class TensorEntry(NamedDtype):
    """One tensor of a file: its bytes are ``[start, end)`` relative to the data start."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class FileHeader:
    """A validated header; ``data_start``: the data's file offset (8 + N)."""

    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    source: str = "<memory>"


def check_header_length(n: int, file_size: int, *, source: str) -> None:
    """``CheckpointError`` unless ``n`` (the 8-byte prefix) fits ``file_size`` and the cap."""
    if n <= 0:
        raise CheckpointError(f"{source}: header length {n} in the first 8 bytes is not positive")
    if n > MAX_HEADER_SIZE:
        raise CheckpointError(
            f"{source}: header length {n} exceeds the {MAX_HEADER_SIZE}-byte cap; "
            "the file is corrupt or not safetensors"
        )
    if n > file_size - 8:
        raise CheckpointError(
            f"{source}: header length {n} runs past the end of the file ({file_size} bytes); "
            "the file is truncated or not safetensors"
        )


def parse_json_object(raw: bytes, *, source: str, what: str) -> dict:
    """Untrusted UTF-8 JSON that must be an object without repeated keys (``CheckpointError``
    naming ``what``)."""

    def no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
        # json.loads keeps the last of repeated keys; a second entry for one tensor would
        # silently hide the first, so a repeat is a fault. A "\ud800" escape decodes to a lone
        # surrogate, which is no Unicode text (safetensors refuses it; printing it fails).
        result: dict[str, object] = {}
        for key, value in pairs:
            if key in result:
                raise CheckpointError(f"{source}: {what} repeats the key {key!r}")
            for text in (key, value):
                if isinstance(text, str) and not text.isascii():
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        raise CheckpointError(
                            f"{source}: {what} holds the string {text!r:.200}, which has an unpaired "
                            "surrogate escape and is not Unicode text") from None
            result[key] = value
        return result

    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except CheckpointError:
        raise
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{source}: {what} is not valid UTF-8 ({e.reason} at byte {e.start})") from e
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{source}: {what} is not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{source}: {what} must be a JSON object, got {type(obj).__name__}")
    return obj


def _parse_entry(name: str, info: object, *, data_size: int, source: str) -> TensorEntry:
    where = f"{source}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: entry must be an object, got {type(info).__name__}")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise CheckpointError(f"{where}: entry has no {key!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _STR_TO_DTYPE:
        raise CheckpointError(f"{where}: {_unknown_dtype(dtype)}")
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} must be a list of non-negative ints")
    shape = torch_shape(dtype, shape, where=where)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} must be two ints [start, end]")
    start, end = offsets
    if not 0 <= start <= end <= data_size:
        raise CheckpointError(
            f"{where}: data_offsets [{start}, {end}] fall outside the data section "
            f"[0, {data_size}]; the file is truncated or corrupt"
        )
    expected = spec_nbytes(dtype, shape)
    if end - start != expected:
        raise CheckpointError(
            f"{where}: data_offsets [{start}, {end}] hold {end - start} bytes but shape "
            f"{stored_shape(dtype, shape)} of {dtype} needs {expected}"
        )
    return TensorEntry(name, dtype, tuple(shape), start, end)


def parse_header(raw_json: bytes, *, data_size: int, source: str) -> FileHeader:
    """The validated header of a file with ``data_size`` data bytes; ``CheckpointError`` naming
    ``source``, the tensor and the fault (JSON, metadata, dtype, shape, offsets, tiling)."""
    obj = parse_json_object(raw_json, source=source, what="header")
    metadata = obj.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not (isinstance(metadata, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise CheckpointError(f"{source}: __metadata__ must map strings to strings, got {metadata!r:.200}")
    entries = {
        name: _parse_entry(name, info, data_size=data_size, source=source) for name, info in obj.items()
    }
    _check_tiling(entries.values(), data_size, source)
    return FileHeader(entries, dict(metadata), 8 + len(raw_json), source)


def _check_tiling(entries, data_size: int, source: str) -> None:
    prev: TensorEntry | None = None
    end = 0
    for entry in sorted(entries, key=lambda e: (e.start, e.end)):
        if entry.start < end:
            assert prev is not None  # end > 0 only once an entry was seen
            raise CheckpointError(
                f"{source}: tensors {prev.name!r} [{prev.start}, {prev.end}) and "
                f"{entry.name!r} [{entry.start}, {entry.end}) overlap"
            )
        if entry.start > end:
            after = f"after tensor {prev.name!r}" if prev is not None else "at the start"
            raise CheckpointError(
                f"{source}: bytes [{end}, {entry.start}) of the data section {after} belong to no "
                f"tensor (the next is {entry.name!r}); the tensors must cover the data exactly, so "
                "the header length or offsets are corrupt"
            )
        prev, end = entry, entry.end
    if end != data_size:
        raise CheckpointError(
            f"{source}: the tensors cover {end} bytes but the data section holds {data_size}; "
            f"{data_size - end} trailing bytes belong to no tensor (a corrupt header length, or "
            "bytes appended to the file)"
        )


def layout_header(
    specs: Sequence[Spec], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The file prefix (8-byte length + JSON space-padded to 8 bytes) of ``specs`` (``(name,
    dtype, shape)``) back to back, and each one's ``(start, end)``; byte-identical to
    ``safetensors.torch.save_file``'s for its order. ``metadata`` defaults to ``{"format": "pt"}``.

    >>> prefix, offsets = layout_header([("w", "F32", (2, 2))])
    >>> len(prefix) % 8, offsets
    (0, {'w': (0, 16)})
    """
    metadata = {"format": "pt"} if metadata is None else metadata
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"metadata must map strings to strings, got {metadata!r:.200}")
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offsets: dict[str, tuple[int, int]] = {}
    pos = 0
    for name, dtype, shape in specs:
        if not isinstance(name, str) or name == "__metadata__" or name in offsets:
            raise CheckpointError(f"tensor name {name!r} is reserved, repeated or not a string")
        if not all(is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"tensor {name!r}: shape {shape!r} must be non-negative ints")
        nbytes = spec_nbytes(dtype, shape)
        offsets[name] = (pos, pos + nbytes)
        stored = list(stored_shape(dtype, shape))
        header[name] = {"dtype": dtype, "shape": stored, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    try:
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise CheckpointError(f"a tensor name or metadata is not encodable as UTF-8 ({e})") from e
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, offsets


def region_runs(
    shape: Sequence[int], itemsize: int, region_offsets: Sequence[int], region_sizes: Sequence[int]
) -> list[tuple[int, int]]:
    """The maximal contiguous byte runs ``(offset, length)`` of a box of a C-contiguous tensor,
    in C order (one Python step per run, never per element).

    >>> region_runs((4, 6), 2, (0, 2), (2, 3))     # two rows, columns 2..4
    [(4, 6), (16, 6)]
    >>> region_runs((4, 6), 2, (1, 0), (2, 6))     # full rows merge
    [(12, 24)]
    """
    shape, offsets, sizes = tuple(shape), tuple(region_offsets), tuple(region_sizes)
    if not len(shape) == len(offsets) == len(sizes):
        raise UsageError(f"box offsets {offsets} / sizes {sizes} do not match shape {shape}: give "
                         "one offset and one size per dim of the tensor")
    if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
        raise UsageError(f"box offsets {offsets} sizes {sizes} fall outside shape {shape}: each "
                         "offset + size must be within its dim")
    if 0 in sizes:
        return []
    strides = [itemsize] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    # run_dim: the last dim the box does not span fully; every dim after it is whole.
    run_dim = len(shape) - 1
    while run_dim >= 0 and sizes[run_dim] == shape[run_dim]:
        run_dim -= 1
    if run_dim < 0:
        return [(0, math.prod(shape) * itemsize)]
    length = sizes[run_dim] * strides[run_dim]
    starts = [sum(o * s for o, s in zip(offsets, strides, strict=True))]
    for d in range(run_dim):
        n, step = sizes[d], strides[d]
        if n > 1:
            starts = [x for s in starts for x in range(s, s + n * step, step)]
    return [(s, length) for s in starts]


def check_tiling(name: str, shape: Sequence[int], pieces: Sequence[tuple[str, Region]]) -> None:
    """Raise ``CheckpointError`` unless the regions of ``pieces`` (``(source, region)``: the
    chunks of a stored tensor, or the chunks a save plans) tile the tensor of ``shape`` exactly:
    each inside, together covering it, none overlapping. The one check of the sharded
    safetensors and DCP chunk maps.

    >>> check_tiling("w", (4, 2), [("a", Region((0, 0), (2, 2))), ("b", Region((2, 0), (2, 2)))])
    """
    shape = tuple(shape)
    for src, r in pieces:
        inside = len(r.offsets) == len(shape) and all(
            o + s <= d for o, s, d in zip(r.offsets, r.sizes, shape, strict=True))
        if not inside:
            raise CheckpointError(f"{src}: tensor {name!r}: chunk at offsets {r.offsets} of sizes "
                                  f"{r.sizes} falls outside shape {shape}")
    covered, total = sum(r.numel for _, r in pieces), math.prod(shape)
    if covered != total:
        files = sorted({s for s, _ in pieces})
        raise CheckpointError(
            f"tensor {name!r}: its chunks in {', '.join(files[:4])}{' ...' if len(files) > 4 else ''} "
            f"cover {covered} of the {total} elements of its shape {shape}, so it is not covered "
            "exactly: a chunk (or a whole rank's file) is missing or repeated: copy the complete "
            "checkpoint folder, or save again")
    pair = overlapping([r for _, r in pieces])
    if pair is not None:
        (sa, a), (sb, b) = pieces[pair[0]], pieces[pair[1]]
        raise CheckpointError(
            f"{sa if sa == sb else f'{sa} and {sb}'}: tensor {name!r}: chunks at offsets {a.offsets} "
            f"(sizes {a.sizes}) and {b.offsets} (sizes {b.sizes}) overlap, so which bytes hold the "
            "tensor is ambiguous; the folder mixes checkpoints or a header is corrupt")
