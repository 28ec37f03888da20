"""``sw.inspect`` / ``shardwise inspect PATH``: what a checkpoint is, without loading a tensor;
and what inspect, verify and diff share: a format's reader opened on a path
(:func:`opened`), its tensors (:func:`stored`) and quantized pairs (:func:`quantized`), and
:func:`print_safely`, through which they print."""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from shardwise.core.header import dtype_to_str, spec_nbytes
from shardwise.core.quant import QuantConfig, read_quantization
from shardwise.errors import CheckpointError
from shardwise.io.formats import open_source
from shardwise.io.source import Stored
from shardwise.io.storage import Location, locate
from shardwise.quant import QuantPair, describe_quantization, stored_pairs


@contextmanager
def opened(where: Location) -> Iterator[Stored]:
    """The reader of the checkpoint at ``where`` (``open_source``), closed on exit; an
    ``OSError`` (a name too long, a permission, an I/O error) is a ``CheckpointError``."""
    try:
        source = open_source(where)
        try:
            yield source
        finally:
            source.close()
    except OSError as e:
        raise CheckpointError(f"{where}: cannot read the checkpoint: {e.filename or where}: "
                              f"{e.strerror or e}") from e


def stored(source: Stored) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (safetensors dtype, shape)}`` of every tensor ``source`` stores."""
    return {n: (dtype_to_str(d), tuple(s)) for n, (d, s) in source.tensors().items()}


def quantized(where: Location, found: Mapping[str, tuple],
              ) -> tuple[QuantConfig, dict[str, QuantPair], list[str]]:
    """``(quantization config, {weight: QuantPair}, problems)`` of the tensors ``found`` in the
    checkpoint at ``where`` (its config beside it: ``stored_pairs``)."""
    qc = read_quantization(where if where.is_folder() else where.parent)
    return (qc, *stored_pairs(found, qc))


def some(names: list[str], quote=repr) -> str:
    """The first five of ``names``, then "..." when there are more."""
    return ", ".join(map(quote, names[:5])) + (", ..." if len(names) > 5 else "")


class JsonReport:
    """``to_dict`` / ``to_json`` of a report dataclass: its fields, the properties named in
    ``FLAGS`` and its ``summary()``."""

    FLAGS: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {**asdict(self), **{f: getattr(self, f) for f in self.FLAGS},  # type: ignore[call-overload]
                "summary": self.summary()}  # type: ignore[attr-defined]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, ensure_ascii=True)


@dataclass
class Report:
    """A checkpoint's description: ``tensors`` rows ``(name, dtype, shape, chunks or None)``,
    ``values`` (non-tensor DCP entries), ``quant`` (``{weight or scales: "fp8_block 128x128"
    [scales]}``) and ``quantization`` (the line about the checkpoint's quantization)."""

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
    ``storage_options`` go to the storage of a URL). Raises ``CheckpointError`` for a bad one.

    >>> inspect_checkpoint("out/dcp").kind                  # doctest: +SKIP
    'torch distributed checkpoint (DCP)'
    """
    where = locate(path, storage_options)
    with opened(where) as source:
        desc, found = source.describe(), stored(source)
        chunks = desc.chunks or {}
        rows = [(n, d, s, chunks.get(n)) for n, (d, s) in found.items()]
        report = Report(where, desc.kind, list(desc.files), rows, list(desc.values), dict(desc.metadata),
                        None if desc.layout is None else dict(desc.layout))
        qc, pairs, _ = quantized(where, found)
    for pair in pairs.values():
        report.quant[pair.values] = pair.describe()
        report.quant[pair.scales] = f"{pair.describe()} scales"
    report.quantization = describe_quantization(qc, pairs)
    return report


def _size(n: float) -> str:
    unit = 0
    while n >= 1000 and unit < 4:
        n, unit = n / 1000, unit + 1
    return f"{n:.0f} B" if unit == 0 else f"{n:.1f} {'kMGT'[unit - 1]}B"


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
    groups = Counter((_LAYER_INDEX.sub("*", path), str(style)) for path, style in plan.items())
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
    file = file or sys.stdout
    try:
        print(text, file=file)
    except UnicodeEncodeError:
        encoding = getattr(file, "encoding", None) or "ascii"
        print(text.encode(encoding, "backslashreplace").decode(encoding), file=file)


def main_inspect(path: str, *, storage_options: dict | None = None) -> int:
    """``shardwise inspect PATH``: print the report; a bad checkpoint is an error message."""
    try:
        print_safely(format_report(inspect_checkpoint(path, storage_options=storage_options)))
    except CheckpointError as e:
        print_safely(f"shardwise inspect: {e}", file=sys.stderr)
        return 1
    return 0


__all__ = ["JsonReport", "Report", "compact_plan", "format_report", "inspect_checkpoint", "main_inspect",
           "opened", "print_safely", "quantized", "some", "stored"]
