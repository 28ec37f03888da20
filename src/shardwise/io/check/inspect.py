"""``shardwise inspect PATH``: what a checkpoint is, without loading a tensor.

A safetensors file or folder (one file, or sharded with an index) is described from its
validated headers; a torch distributed checkpoint from its ``.metadata`` (unpickled with
DCP's classes only) and, when shardwise wrote it, the layout recorded in ``shardwise.json``.
A quantized checkpoint's weights and scales are shown with their scheme and block size (the
``quantization_config`` of its ``config.json``, paired by ``io.check.quant``).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from shardwise.core.header import dtype_to_str, spec_nbytes
from shardwise.errors import CheckpointError
from shardwise.io.check.quant import describe_quantization, quant_pairs, quantization_config
from shardwise.io.dcp.sharded import SHARDING_INFO_KEY, is_sharded_safetensors, read_sharded
from shardwise.io.dcp.sharded_read import ordered_tensors
from shardwise.io.detect import is_dcp
from shardwise.io.info import read_info
from shardwise.io.safetensors.checkpoint import resolve_checkpoint


@dataclass
class Report:
    """A checkpoint's description. ``tensors`` rows are ``(name, dtype, shape, chunks)``
    (``chunks`` is None for safetensors); ``values`` names non-tensor DCP entries. ``quant``
    gives each quantized weight and its scales their scheme and block (``fp8_block 128x128``,
    ``... scales``); ``quantization`` is the line about the checkpoint's quantization."""

    path: Path
    kind: str
    files: list[str]
    tensors: list[tuple[str, str, tuple[int, ...], int | None]]
    values: list[str] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    layout: dict | None = None
    quant: dict[str, str] = field(default_factory=dict)
    quantization: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(spec_nbytes(dtype, shape) for _, dtype, shape, _ in self.tensors)


def inspect_checkpoint(path: str | os.PathLike) -> Report:
    """Describe the checkpoint at ``path`` (safetensors file, folder, index, or DCP folder).

    >>> inspect_checkpoint("out/dcp").kind                  # doctest: +SKIP
    'torch distributed checkpoint (DCP)'
    """
    path = Path(path)
    try:
        report = _inspect(path)
        _quantization(report, path if path.is_dir() else path.parent)
        return report
    except OSError as e:  # a name too long, a permission, an I/O error
        raise CheckpointError(f"{path}: cannot read the checkpoint: {e.filename or path}: "
                              f"{e.strerror or e}") from e


def _inspect(path: Path) -> Report:
    if is_dcp(path):
        return _dcp(path)
    if is_sharded_safetensors(path):
        return _sharded(path)

    ckpt = resolve_checkpoint(path)
    kind = ("safetensors, sharded" if len(ckpt.files) > 1 or path.name.endswith(".json")
            or any(ckpt.root.glob("*.safetensors.index.json")) else "safetensors, one file")
    tensors = []
    for name, file in ckpt.weight_map.items():
        entry = ckpt.headers[file].entries[name]
        tensors.append((name, entry.dtype, entry.shape, None))
    metadata = dict(ckpt.headers[ckpt.files[0]].metadata) if ckpt.files else {}
    return Report(path, kind, [f.name for f in ckpt.files], tensors, metadata=metadata)


def _quantization(report: Report, root: Path) -> None:
    qc = quantization_config(root)
    pairs, _ = quant_pairs({n: (d, s) for n, d, s, _ in report.tensors}, qc)
    for pair in pairs.values():
        report.quant[pair.values] = pair.describe()
        report.quant[pair.scales] = f"{pair.describe()} scales"
    report.quantization = describe_quantization(qc, pairs)


def _sharded(path: Path) -> Report:
    """The report of a sharded safetensors checkpoint (headers only)."""
    ckpt = read_sharded(path)
    rows = [(t.name, t.dtype, t.shape, len(t.chunks)) for t in ordered_tensors(ckpt)]
    meta = {k: v for k, v in ckpt.headers[ckpt.files[0]].metadata.items() if k != SHARDING_INFO_KEY}
    return Report(path, "torch distributed checkpoint in safetensors (DCP_SHARDING_INFO, no pickle)",
                  [f.name for f in ckpt.files], rows, metadata=meta, layout=ckpt.info)


def _dcp(path: Path) -> Report:
    # imported on use: torch.distributed.checkpoint takes ~0.5 s to import, which inspecting a
    # safetensors checkpoint should not pay
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from shardwise.io.dcp.metadata import read_metadata

    metadata = read_metadata(path)
    tensors, values = [], []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors.append((fqn, dtype_to_str(md.properties.dtype), tuple(md.size), len(md.chunks)))
        else:
            values.append(fqn)
    files = sorted({str(info.relative_path) for info in metadata.storage_data.values()})
    return Report(path, "torch distributed checkpoint (DCP)", files, tensors, values,
                  layout=read_info(path))


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _layout_lines(layout: dict | None) -> list[str]:
    if layout is None:
        return ["layout: not recorded (no shardwise.json: written by plain torch.distributed.checkpoint?)"]
    mesh = layout.get("mesh") or {}
    sharded = ", ".join(layout.get("sharded_axes") or [])
    axes = " x ".join(f"{a}={s}" for a, s in zip(mesh.get("axes", []), mesh.get("shape", []), strict=False))
    lines = [
        f"saved by shardwise {layout.get('shardwise', '?')} with torch {layout.get('torch', '?')}: "
        f"{layout.get('kind', '?')} checkpoint, world of {layout.get('world_size', '?')}",
        f"layout: mesh {axes or 'none'}, tp degree {layout.get('degree', '?')}, holding "
        f"{layout.get('holding') or 'n/a'}, sharded over {sharded or 'nothing'}",
    ]
    lines += compact_plan(layout.get("plan") or {})
    extra = layout.get("metadata") or {}
    if extra:
        lines.append("metadata: " + ", ".join(f"{k}={v}" for k, v in extra.items()))
    sums = layout.get("checksums") or {}
    chunks = sums.get("chunks") or {}
    if chunks:
        lines.append(f"checksums: {sums.get('algorithm')} of {sum(map(len, chunks.values()))} chunks "
                     "(`shardwise verify` checks them)")
    return lines


_LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


def compact_plan(plan: dict) -> list[str]:
    """The plan, one line per pattern (``layers.*.attn.q: colwise x24``) rather than one per
    module: a real model has hundreds of layers, each with the same entries."""
    if not plan:
        return []
    groups: dict[tuple[str, str], int] = {}
    for path, style in plan.items():
        key = (_LAYER_INDEX.sub("*", path), str(style))
        groups[key] = groups.get(key, 0) + 1
    lines = [f"plan: {len(plan)} modules in {len(groups)} pattern(s)"]
    lines += [f"  {pattern}: {style}" + (f" x{n}" if n > 1 else "") for (pattern, style), n in groups.items()]
    return lines


def format_report(report: Report) -> str:
    """The text ``shardwise inspect`` prints."""
    dtypes = Counter(dtype for _, dtype, _, _ in report.tensors)
    lines = [f"{report.path}: {report.kind}",
             f"{len(report.tensors)} tensors, {_size(report.total_bytes)} "
             f"({report.total_bytes} bytes) in {len(report.files)} file(s); dtypes: "
             + ", ".join(f"{d} x{n}" for d, n in dtypes.most_common())]
    if report.kind.startswith("torch"):
        lines += _layout_lines(report.layout)
        if report.values:
            lines.append(f"{len(report.values)} non-tensor values (e.g. {report.values[0]})")
    elif report.metadata:
        lines.append("metadata: " + ", ".join(f"{k}={v}" for k, v in report.metadata.items()))
    if report.quantization:
        lines.append(report.quantization)
    width = max([len(n) for n, *_ in report.tensors] + [4])
    chunks = report.kind.startswith("torch")
    lines.append("")
    head = f"{'name':<{width}}  {'dtype':<7} {'shape':<18} {'bytes':>12}"
    lines.append(head + ("  chunks" if chunks else "") + ("  quant" if report.quant else ""))
    for name, dtype, shape, n in report.tensors:
        shown = "x".join(map(str, shape)) or "scalar"
        row = f"{name:<{width}}  {dtype:<7} {shown:<18} {spec_nbytes(dtype, shape):>12}"
        row += f"  {n:>6}" if chunks else ""
        lines.append((row + f"  {report.quant.get(name, '')}").rstrip() if report.quant else row)
    return "\n".join(lines)


def print_safely(text: str, file=None) -> None:
    """Print ``text`` whatever the terminal's encoding: characters it cannot show (a tensor
    name in another script on an ASCII terminal) are written as escapes, not a traceback."""
    import sys

    file = file or sys.stdout
    try:
        print(text, file=file)
    except UnicodeEncodeError:
        encoding = getattr(file, "encoding", None) or "ascii"
        print(text.encode(encoding, "backslashreplace").decode(encoding), file=file)


def main_inspect(path: str) -> int:
    """``shardwise inspect PATH``: print the report; a bad checkpoint is an error message."""
    import sys

    try:
        print_safely(format_report(inspect_checkpoint(path)))
    except CheckpointError as e:
        print_safely(f"shardwise inspect: {e}", file=sys.stderr)
        return 1
    return 0


__all__ = ["Report", "compact_plan", "format_report", "inspect_checkpoint", "main_inspect", "print_safely"]
