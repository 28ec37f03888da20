"""``sw.inspect`` / ``shardwise inspect PATH``: what a checkpoint is, without loading a tensor
(its reader's tensors and description, quantized weights with scheme and block), and
:func:`print_safely`, through which inspect, verify and diff print."""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field

from shardwise.core.header import dtype_to_str, spec_nbytes
from shardwise.core.quant import read_quantization
from shardwise.errors import CheckpointError
from shardwise.io.formats import open_source
from shardwise.io.storage import Location, locate
from shardwise.quant import describe_quantization, stored_pairs


@dataclass
class Report:
    """A checkpoint's description. ``tensors`` rows are ``(name, dtype, shape, chunks)``
    (``chunks`` is None for safetensors); ``values`` names non-tensor DCP entries. ``quant``
    gives each quantized weight and its scales their scheme and block (``fp8_block 128x128``,
    ``... scales``); ``quantization`` is the line about the checkpoint's quantization."""

    path: Location
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


def inspect_checkpoint(path: str | os.PathLike, *, storage_options: dict | None = None) -> Report:
    """Describe the checkpoint at ``path`` (safetensors file, folder, index, or DCP folder;
    ``storage_options`` go to the storage of a URL).

    >>> inspect_checkpoint("out/dcp").kind                  # doctest: +SKIP
    'torch distributed checkpoint (DCP)'
    """
    where = locate(path, storage_options)
    try:
        report = _inspect(where)
        _quantization(report, where if where.is_folder() else where.parent)
        return report
    except OSError as e:  # a name too long, a permission, an I/O error
        raise CheckpointError(f"{where}: cannot read the checkpoint: {e.filename or where}: "
                              f"{e.strerror or e}") from e


def _inspect(path: Location) -> Report:
    source = open_source(path)
    try:
        desc = source.describe()
        chunks = desc.chunks or {}
        rows = [(n, dtype_to_str(d), tuple(s), chunks.get(n)) for n, (d, s) in source.tensors().items()]
    finally:
        source.close()
    return Report(path, desc.kind, list(desc.files), rows, list(desc.values), metadata=dict(desc.metadata),
                  layout=None if desc.layout is None else dict(desc.layout))


def _quantization(report: Report, root: Location) -> None:
    qc = read_quantization(root)
    pairs, _ = stored_pairs({n: (d, s) for n, d, s, _ in report.tensors}, qc)
    for pair in pairs.values():
        report.quant[pair.values] = pair.describe()
        report.quant[pair.scales] = f"{pair.describe()} scales"
    report.quantization = describe_quantization(qc, pairs)


def _size(n: float) -> str:
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


def main_inspect(path: str, *, storage_options: dict | None = None) -> int:
    """``shardwise inspect PATH``: print the report; a bad checkpoint is an error message."""
    import sys

    try:
        print_safely(format_report(inspect_checkpoint(path, storage_options=storage_options)))
    except CheckpointError as e:
        print_safely(f"shardwise inspect: {e}", file=sys.stderr)
        return 1
    return 0


__all__ = ["Report", "compact_plan", "format_report", "inspect_checkpoint", "main_inspect", "print_safely"]
