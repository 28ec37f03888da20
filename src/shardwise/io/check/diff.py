"""``sw.diff`` / ``shardwise diff A B``: two checkpoints of any formats compared tensor by tensor,
in slabs of whole rows; byte for byte unless a cast or tolerance is given. A hub-layout side is
matched to module names through its ``config.json``; FP8 weights that differ are compared
dequantized, with their scales."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field

import torch

from shardwise.core.spec import Region
from shardwise.errors import CheckpointError, UsageError
from shardwise.io.check import JsonReport, opened, print_safely
from shardwise.io.check.against import as_dtype
from shardwise.io.source import Stored
from shardwise.io.staging import cast
from shardwise.io.storage import locate, split_scheme
from shardwise.quant import Dequantizing, fp8_pairs

_SLAB_BYTES = 64 << 20


@dataclass
class TensorDiff:
    """A tensor on both sides that is not identical. ``equal``: every value the same (False when
    the dtype or shape differs); ``max_abs_diff`` over float64 values (None when the shapes
    differ, nan for a NaN on one side only), in dequantized units when ``dequantized`` (an FP8
    side); ``within``: every value within the diff's tolerance (after its cast)."""

    name: str
    dtype_a: str
    dtype_b: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    equal: bool
    max_abs_diff: float | None
    dequantized: bool = False
    within: bool = False


@dataclass
class DiffReport(JsonReport):
    """What :func:`diff` found: names on one side only, tensors that differ, how many are
    identical (dtype, shape, bytes); ``scales_a`` / ``scales_b``: FP8 scales of one side only
    (compared within their weight's dequantized values); ``close``: tensors whose bytes differ but
    whose values agree within the ``tolerance``; ``equivalent``: nothing else differs."""

    a: str
    b: str
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    differ: list[TensorDiff] = field(default_factory=list)
    same: int = 0
    scales_a: list[str] = field(default_factory=list)
    scales_b: list[str] = field(default_factory=list)
    close: list[str] = field(default_factory=list)
    tolerance: dict | None = None  # {"atol", "rtol", "dtype"} when the diff had one

    FLAGS = ("identical", "equivalent")

    @property
    def identical(self) -> bool:
        return not (self.only_a or self.only_b or self.differ or self.close)

    @property
    def equivalent(self) -> bool:
        return not (self.only_a or self.only_b or self.differ)

    def summary(self) -> str:
        """One line: identical, equivalent (within the tolerance) or different, with the counts."""
        within = f"{len(self.close)} within tolerance, " if self.tolerance is not None else ""
        counts = (f"{self.same} identical, {within}{len(self.differ)} differ, {len(self.only_a)} only in A, "
                  f"{len(self.only_b)} only in B")
        dequantized = sum(d.dequantized for d in self.differ)
        if dequantized:
            counts += f" ({dequantized} FP8 weight(s) compared dequantized)"
        if self.tolerance is not None:
            counts += " (" + ", ".join(f"{k}={v}" for k, v in self.tolerance.items() if v is not None) + ")"
        verdict = "IDENTICAL" if self.identical else "EQUIVALENT" if self.equivalent else "DIFFERENT"
        return f"{verdict}: {counts}"

    def to_dict(self) -> dict:
        out = super().to_dict()
        for d in out["differ"]:  # JSON has no NaN
            if d["max_abs_diff"] is not None and math.isnan(d["max_abs_diff"]):
                d["max_abs_diff"] = "nan"
        return out


class _Side:
    """One side of a diff: a reader's tensors (``{name: (dtype, shape)}``) read in slabs of
    whole rows (``rows(name, lo, hi)``), and its ``root``."""

    def __init__(self, source: Stored):
        self.source, self.root = source, source.root
        self.tensors = dict(source.tensors())

    def use_module_names(self, wanted: set[str]) -> None:
        self.source.use_module_names(wanted)
        self.tensors = dict(self.source.tensors())

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of tensor ``name`` (the whole of a 0-d tensor)."""
        shape = self.tensors[name][1]
        if not shape:
            return self.source.read_box(name, Region((), ()))
        box = Region((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + tuple(shape[1:]))
        return self.source.read_box(name, box)


@dataclass(frozen=True)
class _Tolerance:
    atol: float
    rtol: float
    dtype: torch.dtype | None

    def values(self, t: torch.Tensor) -> torch.Tensor:
        return _as_float64(cast(t, self.dtype))


def _tolerance(atol, rtol, dtype) -> _Tolerance | None:
    if atol is None and rtol is None and dtype is None:
        return None
    for name, v in (("atol", atol), ("rtol", rtol)):
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise UsageError(f"{name} must be a finite number >= 0, got {v!r}")
    return _Tolerance(float(atol or 0.0), float(rtol or 0.0), as_dtype(dtype))


def _compare(name: str, a, b, slab_bytes: int, tol: _Tolerance | None = None) -> TensorDiff | None:
    (dtype_a, shape_a), (dtype_b, shape_b) = a.tensors[name], b.tensors[name]
    if shape_a != shape_b:
        return _differ(name, a, b, False, None)
    rows = shape_a[0] if shape_a else 1
    row_bytes = max(1, math.prod(shape_a[1:]) * max(dtype_a.itemsize, dtype_b.itemsize))
    step = max(1, slab_bytes // row_bytes)
    same_bytes, equal, worst, within = dtype_a == dtype_b, True, 0.0, tol is not None
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        x, y = a.rows(name, lo, hi), b.rows(name, lo, hi)
        if same_bytes and not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            same_bytes = False
        if x.numel():
            xd, yd = _as_float64(x), _as_float64(y)
            both_nan = xd.isnan() & yd.isnan()
            delta = torch.where(both_nan, torch.zeros((), dtype=xd.dtype), (xd - yd).abs())
            equal = equal and bool(torch.equal(xd[~both_nan], yd[~both_nan]))
            worst = max(worst, float(delta.max()), key=lambda v: (math.isnan(v), v))
            if within and tol is not None:
                within = bool(torch.isclose(tol.values(x), tol.values(y), rtol=tol.rtol, atol=tol.atol,
                                            equal_nan=True).all())
    if same_bytes:
        return None
    return _differ(name, a, b, equal and dtype_a == dtype_b, worst, within=within)


def _compare_quantized(name: str, a, b, pairs, sides: tuple[Dequantizing, Dequantizing], found: dict,
                       slab_bytes: int) -> TensorDiff | None:
    """An FP8 weight of one side or both: byte for byte where both hold it quantized with the
    same bytes and the same scales, else its dequantized values (``sides``) compared."""
    if name in pairs[0] and name in pairs[1] and a.tensors[name] == b.tensors[name]:
        scale = pairs[0][name].scales
        if scale == pairs[1][name].scales and found.get(scale, 0) is None:  # scales byte-equal
            if _compare(name, a, b, slab_bytes) is None:
                return None
    if a.tensors[name][1] != b.tensors[name][1]:
        return _differ(name, a, b, False, None)
    values = _compare(name, *sides, slab_bytes)
    worst = 0.0 if values is None else values.max_abs_diff
    return _differ(name, a, b, worst == 0.0, worst, dequantized=True)


def _differ(name: str, a, b, equal: bool, worst: float | None, **kw) -> TensorDiff:
    (dtype_a, shape_a), (dtype_b, shape_b) = a.tensors[name], b.tensors[name]
    return TensorDiff(name, str(dtype_a).removeprefix("torch."), str(dtype_b).removeprefix("torch."),
                      shape_a, shape_b, equal, worst, **kw)


def _as_float64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.complex128 if t.is_complex() else torch.float64)


def diff(a: str | os.PathLike, b: str | os.PathLike, *, atol: float | None = None,
         rtol: float | None = None, dtype: torch.dtype | str | None = None,
         slab_bytes: int = _SLAB_BYTES, storage_options: dict | None = None) -> DiffReport:
    """Compare the checkpoints ``a`` and ``b`` (any formats, degrees, hub or module names) tensor
    by tensor, at most ``slab_bytes`` of each side at a time: names on one side only, dtype and
    shape differences, same bytes, the largest absolute difference. With ``atol``, ``rtol`` or
    ``dtype``, a tensor whose values (floating ones cast to ``dtype``) all pass
    ``torch.isclose(a, b, rtol, atol)`` is in ``close`` (FP8 weights compared dequantized stay
    exact). ``storage_options`` go to each URL side. Raises ``CheckpointError`` if either
    cannot be read, ``UsageError`` for a bad tolerance.

    >>> report = sw.diff("out/full", "out/dcp")           # doctest: +SKIP
    >>> report.identical, report.summary()               # doctest: +SKIP
    (True, 'IDENTICAL: 291 identical, 0 differ, 0 only in A, 0 only in B')
    >>> sw.diff("bf16/", "fp32/", dtype="bfloat16").equivalent   # doctest: +SKIP
    True
    """
    tol = _tolerance(atol, rtol, dtype)
    a_at, b_at = (locate(x, storage_options if split_scheme(x)[0] else None) for x in (a, b))
    report = DiffReport(str(a), str(b))
    if tol is not None:
        report.tolerance = {"atol": tol.atol, "rtol": tol.rtol,
                            "dtype": None if tol.dtype is None else str(tol.dtype).removeprefix("torch.")}
    with opened(a_at) as source_a, opened(b_at) as source_b:
        left, right = _Side(source_a), _Side(source_b)
        left.use_module_names(set(right.tensors) - set(left.tensors))
        right.use_module_names(set(left.tensors) - set(right.tensors))
        pairs = fp8_pairs(left, left.root), fp8_pairs(right, right.root)
        report.scales_a = [p.scales for n, p in pairs[0].items()
                           if n in right.tensors and p.scales not in right.tensors]
        report.scales_b = [p.scales for n, p in pairs[1].items()
                           if n in left.tensors and p.scales not in left.tensors]
        report.only_a = [n for n in left.tensors if n not in right.tensors and n not in report.scales_a]
        report.only_b = [n for n in right.tensors if n not in left.tensors and n not in report.scales_b]
        common = [n for n in left.tensors if n in right.tensors]
        found = {n: _compare(n, left, right, slab_bytes, tol) for n in common if n not in pairs[0]
                 and n not in pairs[1]}
        sides = Dequantizing(left, pairs[0], left.root), Dequantizing(right, pairs[1], right.root)
        for name in common:
            if name not in found:
                found[name] = _compare_quantized(name, left, right, pairs, sides, found, slab_bytes)
    for name in common:
        result = found[name]
        if result is None:
            report.same += 1
        elif result.within:
            report.close.append(name)
        else:
            report.differ.append(result)
    return report


def main_diff(a: str, b: str, *, as_json: bool = False, atol: float | None = None,
              rtol: float | None = None, dtype: str | None = None,
              storage_options: dict | None = None) -> int:
    """``shardwise diff A B [--atol X] [--rtol Y] [--dtype D] [--json]``: 0 when identical (or,
    with a tolerance, equivalent), 1 when they differ, 2 when one cannot be read."""
    try:
        report = diff(a, b, atol=atol, rtol=rtol, dtype=dtype, storage_options=storage_options)
    except (CheckpointError, UsageError) as e:
        print_safely(f"shardwise diff: {e}", file=sys.stderr)
        return 2
    if as_json:
        print_safely(report.to_json())
        return 0 if report.equivalent else 1
    for name in report.only_a:
        print_safely(f"  only in A: {name}")
    for name in report.only_b:
        print_safely(f"  only in B: {name}")
    for d in report.differ:
        what = []
        if d.dtype_a != d.dtype_b:
            what.append(f"dtype {d.dtype_a} vs {d.dtype_b}")
        if d.shape_a != d.shape_b:
            what.append(f"shape {d.shape_a} vs {d.shape_b}")
        elif d.equal:
            what.append("equal values" + (" once dequantized" if d.dequantized else ""))
        else:
            what.append(f"max abs diff {d.max_abs_diff:.6g}" + (" (dequantized)" if d.dequantized else ""))
        print_safely(f"  differs: {d.name}: {', '.join(what)}")
    hint = _dtype_hint(report) if dtype is None else None
    if hint:
        print_safely(f"  hint: {hint}")
    print_safely(report.summary())
    return 0 if report.equivalent else 1


def _dtype_hint(report: DiffReport) -> str | None:
    """Where the two sides hold the same names and shapes and every difference is of dtype (a
    bfloat16 save of a float32 model), the flag that compares their values."""
    if report.equivalent or report.only_a or report.only_b or not report.differ:
        return None
    if any(d.dtype_a == d.dtype_b or d.shape_a != d.shape_b for d in report.differ):
        return None
    import torch

    narrow = min({d.dtype_a for d in report.differ} | {d.dtype_b for d in report.differ},
                 key=lambda n: getattr(torch, n).itemsize if hasattr(torch, n) else 99)
    return (f"only dtypes differ ({len(report.differ)} tensors); to compare the values, cast both "
            f"sides: --dtype {narrow}")


__all__ = ["DiffReport", "TensorDiff", "diff", "main_diff"]
