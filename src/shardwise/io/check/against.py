"""What a checkpoint of a model must hold (:func:`expected_tensors`, from meta tensors only) and
``sw.verify(path, against=...)``'s check of it (:func:`check_against`). Dtypes are compared
only against a model in hand or a given ``dtype`` (a config's ``dtype`` does not define every
tensor's)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from shardwise.core.adapter import adapter_for, config_model
from shardwise.core.header import dtype_to_str, str_to_dtype
from shardwise.core.plan import resolve_plan
from shardwise.core.spec import global_shape
from shardwise.errors import CheckpointError, UsageError
from shardwise.holding import is_dtensor
from shardwise.io.check import some
from shardwise.io.staging import loaded_dtype
from shardwise.parallel import get_shard_state

Expected = dict[str, tuple[tuple[int, ...], str]]
LAYOUTS = ("hub", "module")


def expected_tensors(source: nn.Module | str | os.PathLike, *, layout: str = "hub",
                     dtype: torch.dtype | str | None = None,
                     tensors: Mapping[str, tuple[tuple[int, ...], str]] | None = None) -> Expected:
    """``{stored key: (global shape, safetensors dtype)}`` that a checkpoint of ``source`` (a
    model, sharded or not; a model folder or its ``config.json``, built on meta) holds in
    ``layout`` ("hub" or "module"), in order. ``tensors`` (``{model tensor: (global shape,
    dtype)}``, ties once) stands for the model's own; ``dtype`` casts the floating ones. Raises
    ``UsageError`` for a bad argument, ``CheckpointError`` when the model cannot be built.

    >>> expected_tensors("hrm/")["model.H_module.layers.0.attn.gqkv_proj.weight"]  # doctest: +SKIP
    ((256, 64), 'F32')
    """
    if layout not in LAYOUTS:
        raise UsageError(f"layout must be 'hub' or 'module', got {layout!r}")
    return expectations(source, dtype=dtype, tensors=tensors, layouts=(layout,))[0].tensors


def resolve_model(source: nn.Module | str | os.PathLike) -> tuple[nn.Module, str]:
    """``(model, what to call it in a message)``: ``source`` itself, or the meta model its
    config builds."""
    if isinstance(source, nn.Module):
        return source, type(source).__name__
    if not isinstance(source, (str, os.PathLike)):
        raise UsageError(f"against must be a model, a model folder or its config.json, "
                         f"got {type(source).__name__}")
    path = Path(source)
    if not (path.is_dir() or path.is_file()):
        raise UsageError(f"{path}: no such folder or file, so no config.json there; pass the model folder "
                         "(config.json beside the weights), its config.json, or the model itself")
    model = config_model(path)  # the model libraries' adapters know their config files
    if model is None:
        raise CheckpointError(f"{path}: no model config there that names its class (a config.json with "
                              "'architectures' for transformers, '_class_name' for diffusers); pass the "
                              "model folder, its config file, or the model itself")
    return model, f"{type(model).__name__} from {path}"


def model_tensors(model: nn.Module) -> tuple[Expected, dict[str, str]]:
    """``({tensor name: (global shape, dtype)}, {tied alias: name kept})`` of ``model``'s state
    dict, from shapes only (``collect_items``' rule: it refuses a meta model)."""
    state = get_shard_state(model)
    specs = state.specs if state is not None else resolve_plan(model, {}, 1)
    held = model.state_dict(keep_vars=True)
    out: Expected = {}
    for name, spec in specs.items():
        if name not in held:
            raise CheckpointError(f"tensor {name!r} was parallelised but is no longer in the model's "
                                  "state_dict; pass the model as it was parallelised or loaded")
        t = held[name]
        shape = tuple(t.shape)  # a DTensor's shape is global
        if name in specs.ties:  # an FP8 weight's scales: local shards may overlap
            shape = specs.ties[name].scale_shape
        elif state is not None and not is_dtensor(t) and not spec.replicated:  # a plain local shard
            degree = state.gather_coords(spec)[0]  # 1: the holding keeps global tensors
            shape = global_shape(shape, spec, degree) if degree > 1 else shape
        out[name] = (shape, dtype_to_str(t.dtype))
    return out, {a: k for a, k in specs.aliases.items() if a in held}


def _checked(tensors: Mapping) -> Expected:
    out = {}
    for name, value in tensors.items():
        try:
            shape, dt = value
            out[name] = (tuple(int(s) for s in shape), dt if isinstance(dt, str) else dtype_to_str(dt))
        except (TypeError, ValueError) as e:
            raise UsageError(f"tensors[{name!r}] must be (shape, dtype), got {value!r}") from e
    return out


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from ``torch.bfloat16``, ``"bfloat16"``, ``"torch.bfloat16"`` or ``"BF16"``."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        found = getattr(torch, name, None)
        if isinstance(found, torch.dtype):
            return found
        try:
            return str_to_dtype(name.upper())
        except CheckpointError:
            pass
    raise UsageError(f"dtype must be a torch dtype or its name ('bfloat16', 'BF16'), got {dtype!r}")


def stored_layout(model: nn.Module, tensors: Expected, aliases: Mapping[str, str],
                  layout: str) -> tuple[Expected, dict[str, str]]:
    """``(tensors, aliases)`` under their stored names in ``layout``; a tied alias keeps its
    place in the hub layout only where it reverts to one key."""
    if layout == "module":
        return dict(tensors), dict(aliases)
    adapter = adapter_for(model)
    ignored = adapter.unsaved(model)
    kept = {n: v for n, v in tensors.items() if n not in ignored}
    stored = adapter.stored_names(model, kept)
    stored_aliases = {}
    for alias, name in aliases.items():
        if name in kept:
            one = adapter.stored_names(model, {alias: kept[name]})
            mine = adapter.stored_names(model, {name: kept[name]})
            if len(one) == len(mine) == 1 and next(iter(mine)) in stored:
                stored_aliases[next(iter(one))] = next(iter(mine))
    return stored, stored_aliases


@dataclass(frozen=True)
class Expectation:
    """What ``layout`` of a model holds: ``tensors``, ``aliases`` (a tied tensor's other stored
    name -> its key) and whether the dtypes are defined (compared)."""

    what: str
    layout: str
    tensors: Expected = field(repr=False)
    aliases: dict[str, str] = field(repr=False)
    dtypes: bool


def expectations(source, *, dtype: torch.dtype | str | None = None, tensors: Mapping | None = None,
                 layouts: tuple[str, ...] = LAYOUTS) -> list[Expectation]:
    """What ``source`` holds in each of ``layouts`` (a layout the same as one before it once);
    ``tensors`` (``{model tensor: (global shape, dtype)}``, ties once) stands for the model's own.
    Dtypes are compared for a model in hand or when ``dtype`` is given."""
    dtype = as_dtype(dtype)
    model, what = resolve_model(source)
    held, aliases = model_tensors(model) if tensors is None else (_checked(tensors), {})
    if dtype is not None:  # as model.to(dtype): the floating tensors only
        held = {n: (s, dtype_to_str(loaded_dtype(str_to_dtype(d), dtype))) for n, (s, d) in held.items()}
    dtypes = dtype is not None or isinstance(source, nn.Module)
    out: list[Expectation] = []
    for layout in layouts:
        stored, stored_aliases = stored_layout(model, held, aliases, layout)
        if not any(e.tensors == stored for e in out):
            out.append(Expectation(what, layout, stored, stored_aliases, dtypes))
    return out


@dataclass
class AgainstReport:
    """A checkpoint's tensors against what ``model`` expects in ``layout``: ``missing`` from it,
    ``unexpected`` in it, ``wrong`` (another shape or dtype; one line each)."""

    model: str
    layout: str
    dtypes_compared: bool
    expected: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.wrong)

    def problems(self) -> list[str]:
        """One line per kind of fault (names listed, five at most) and one per wrong tensor."""
        out, where = [], f"{self.model} ({self.layout} layout)"
        if self.missing:
            out.append(f"{len(self.missing)} tensor(s) that {where} expects are not in the checkpoint: "
                       f"{some(self.missing)}")
        if self.unexpected:
            out.append(f"{len(self.unexpected)} tensor(s) in the checkpoint are not in {where}: "
                       f"{some(self.unexpected)}")
        out += [f"tensor {line}" for line in self.wrong]
        return out

    def summary(self) -> str:
        what = "names, shapes and dtypes" if self.dtypes_compared else "names and shapes; dtypes not compared"
        return f"{'matches' if self.ok else 'does not match'} {self.model} ({self.layout} layout: {what})"


def compare(found: Mapping[str, tuple[str, tuple]], expected: Expectation) -> AgainstReport:
    """Check ``found`` (``{stored key: (dtype, shape)}``, as ``verify`` reads a checkpoint)
    against ``expected``. A tied tensor may be stored under any of its names."""
    report = AgainstReport(expected.what, expected.layout, expected.dtypes, len(expected.tensors))
    covered = set()
    for name, (dt, shape) in found.items():
        key = name if name in expected.tensors else expected.aliases.get(name)
        if key is None:
            report.unexpected.append(name)
            continue
        covered.add(key)
        want_shape, want_dt = expected.tensors[key]
        shape = tuple(shape)
        if shape != want_shape or (expected.dtypes and dt != want_dt):
            got, want = ((f"{dt} {shape}", f"{want_dt} {want_shape}") if expected.dtypes
                         else (shape, want_shape))
            report.wrong.append(f"{name!r} is {got} in the checkpoint, but {report.model} expects {want}")
    report.missing = [k for k in expected.tensors if k not in covered]
    return report


def check_against(found: Mapping[str, tuple[str, tuple]], candidates: list[Expectation], *,
                  layout: str = "auto", prefer: str = "hub") -> AgainstReport:
    """:func:`compare` with the candidate of ``layout``; with ``"auto"``, the one whose names
    the checkpoint matches best (ties: ``prefer``, the layout its format usually holds)."""
    if layout not in ("auto", *LAYOUTS):
        raise UsageError(f"layout must be 'auto', 'hub' or 'module', got {layout!r}")
    if len(candidates) == 1:  # the model's hub layout is its module layout: its own names
        candidates = [replace(candidates[0], layout="module" if layout == "auto" else layout)]
    reports = [compare(found, e) for e in candidates if layout in ("auto", e.layout)]
    return min(reports, key=lambda r: (len(r.missing) + len(r.unexpected), r.layout != prefer))


__all__ = ["AgainstReport", "Expectation", "check_against", "compare", "expectations", "expected_tensors",
           "model_tensors", "resolve_model"]
