"""Checkpoints in their hub key layout, read through region math.

transformers' ``save_pretrained`` writes the layout a model was published in, not the one
its modules hold: a Mixtral checkpoint stores ``...block_sparse_moe.experts.3.w1.weight``
per expert where the module holds one fused ``mlp.experts.gate_up_proj``. transformers
converts on load (``conversion_mapping.py``: renamings, and converters whose operations
stack and concatenate). Here those conversions become geometry instead of copies: a model
tensor is a list of :class:`~shardwise.core.spec.Piece`\\ s (which stored tensor lands at
which offset), and a rank reads only the boxes of the stored tensors its regions overlap.

The mapping is read from the installed transformers (its own rename and match functions),
never copied. Operations that are not region maps (transposes, dequantisation, ...) are
refused with the converter's name before any byte is read.

The save direction (model tensors back to stored tensors) is ``hub_save.py``; it reuses this
module's region map, so both directions share one reading of the conversions.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from shardwise.core.header import NamedDtype
from shardwise.core.pieces import Composite, Piece
from shardwise.core.spec import Region
from shardwise.errors import CheckpointError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from shardwise.io.storage import Location


@dataclass
class _Virtual:  # a tensor in the middle of a chain of operations
    shape: tuple[int, ...]
    pieces: list[Piece]


def _stack(parts: list[_Virtual], dim: int, what: str) -> _Virtual:
    if len({p.shape for p in parts}) != 1:
        raise CheckpointError(f"{what}: stacked tensors differ in shape: {sorted({p.shape for p in parts})}")
    pieces = []
    for j, part in enumerate(parts):
        for q in part.pieces:
            offsets = q.offsets[:dim] + (j,) + q.offsets[dim:]
            stacked = tuple(d + 1 if d >= dim else d for d in q.stacked) + (dim,)
            pieces.append(Piece(q.key, q.source, offsets, tuple(sorted(stacked))))
    shape = parts[0].shape
    return _Virtual(shape[:dim] + (len(parts),) + shape[dim:], pieces)


def _concat(parts: list[_Virtual], dim: int, what: str) -> _Virtual:
    rest = {p.shape[:dim] + p.shape[dim + 1:] for p in parts}
    if len(rest) != 1:
        shapes = [p.shape for p in parts]
        raise CheckpointError(f"{what}: concatenated tensors differ off dim {dim}: {shapes}")
    pieces, start = [], 0
    for part in parts:
        for q in part.pieces:
            offsets = q.offsets[:dim] + (q.offsets[dim] + start,) + q.offsets[dim + 1:]
            pieces.append(Piece(q.key, q.source, offsets, q.stacked))
        start += part.shape[dim]
    shape = parts[0].shape
    return _Virtual(shape[:dim] + (start,) + shape[dim + 1:], pieces)


def _natural(key: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def _indices_run(keys: list[str], what: str) -> None:
    """Stacked per-expert keys must be experts 0..n-1, each once (checked on the last index
    that differs between the keys)."""
    found = [tuple(int(n) for n in re.findall(r"\.(\d+)\.", k)) for k in keys]
    varying = [i for i in range(min(map(len, found), default=0)) if len({f[i] for f in found}) > 1]
    if len(keys) > 1 and varying:
        idx = sorted(f[varying[-1]] for f in found)
        if idx != list(range(len(keys))):
            raise CheckpointError(f"{what}: expected experts 0..{len(keys) - 1} once each, "
                                  f"found indices {idx}")


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel``, read off its class hierarchy
    (transformers is not imported for a model that is not one of its own)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


class _Mapping:
    """transformers' conversions for one model, applied to checkpoint keys."""

    def __init__(self, model: nn.Module):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key

        transforms = get_model_conversion_mapping(cast("PreTrainedModel", model))  # is_transformers_model
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        # called with the non-converter transforms as the renamings, as transformers' loader does
        self._rename: Callable[..., tuple[str, str | None]] = rename_source_key
        self.prefix = getattr(model, "base_model_prefix", None)
        self.meta = dict.fromkeys(model.state_dict(keep_vars=True))

    def target(self, key: str):
        """``(model key, converter or None, source pattern)`` of a stored key."""
        name, pattern = self._rename(key, self.renamings, self.converters, self.prefix, self.meta)
        if pattern is None:
            return name, None, None
        renamed = key
        for r in self.renamings:
            renamed, _ = r.rename_source_key(renamed)
        for conv in self.converters:
            _, p = conv.rename_source_key(renamed)
            if p is not None:
                return name, conv, p
        return name, None, None


def _as_list(v: list[_Virtual] | _Virtual) -> list[_Virtual]:
    return v if isinstance(v, list) else [v]


def _apply(conv, groups: dict[str, list[_Virtual]], what: str) -> _Virtual:
    """Run ``conv``'s operations as geometry over the collected stored tensors."""
    ops = list(getattr(conv, "operations", []) or [])
    current: Mapping[str, list[_Virtual] | _Virtual] = groups
    for op in ops:
        name = type(op).__name__
        dim: Any = getattr(op, "dim", None)  # an int on the operations handled below
        if name == "MergeModulelist":
            current = {p: _stack(_as_list(v), dim, what) for p, v in current.items()}
        elif name == "Concatenate":
            order = [p for p in conv.source_patterns if p in current] or list(current)
            parts = [x for p in order for x in _as_list(current[p])]
            current = {"": _concat(parts, dim, what)}
        else:
            raise CheckpointError(
                f"{what}: transformers converts it with {type(conv).__name__}({name}), which is not a "
                "region map (it transforms values, not just their places); shardwise cannot stream it. "
                "Load the model with transformers and sw.save it (module layout), then load that")
    values = list(current.values())
    if len(values) != 1:
        raise CheckpointError(f"{what}: the converter leaves {len(values)} tensors for one target")
    single = values[0]
    if isinstance(single, list):
        if len(single) != 1:
            raise CheckpointError(f"{what}: {len(single)} stored tensors for one target and no operation")
        single = single[0]
    return single


def _whole(key: str, entry: NamedDtype) -> Piece:
    zeros = (0,) * len(entry.shape)
    return Piece(key, Region(zeros, entry.shape), zeros)


def _split_targets(conv, key: str, name: str, entry: NamedDtype, shapes: dict, what: str) -> dict:
    """``{model tensor: Piece}`` for a converter that splits one stored tensor into several
    (``Split``: sizes of the model tensors; ``Chunk``: equal parts), each a slab of it."""
    ops = list(getattr(conv, "operations", []) or [])
    op = type(ops[0]).__name__ if len(ops) == 1 else "+".join(type(o).__name__ for o in ops)
    if op not in ("Split", "Chunk"):
        raise CheckpointError(f"{what}: transformers converts it with {type(conv).__name__}({op}), which "
                              "is not a region map; shardwise cannot stream it")
    dim, first = ops[0].dim, conv.target_patterns[0]
    names = [name.replace(first, t) for t in conv.target_patterns]
    n = entry.shape[dim]
    if op == "Split":
        missing = [t for t in names if t not in shapes]
        if missing:
            raise CheckpointError(f"{what}: split into {missing}, which the model does not have")
        sizes = [shapes[t][dim] for t in names]
    else:
        step = -(-n // len(names))
        sizes = [max(0, min(step, n - i * step)) for i in range(len(names))]
    if sum(sizes) != n:
        raise CheckpointError(f"{what}: {key!r} has {n} rows on dim {dim} but its parts need {sum(sizes)}")
    out, start = {}, 0
    for target, size in zip(names, sizes, strict=True):
        offsets = tuple(start if d == dim else 0 for d in range(len(entry.shape)))
        box = tuple(size if d == dim else s for d, s in enumerate(entry.shape))
        out[target] = Piece(key, Region(offsets, box), (0,) * len(box))
        start += size
    return out


def hub_tensors(model: nn.Module, stored: Mapping[str, tuple[Location | None, NamedDtype]],
                wanted: set[str], shapes: dict[str, tuple[int, ...]] | None = None,
                ) -> tuple[dict[str, Composite], set[str]]:
    """``({model tensor: Composite}, stored keys used)`` for the tensors of ``wanted`` that a
    transformers conversion builds from ``stored`` (``{key: (file or None, entry)}``). Empty when
    the model is not a transformers model or transformers is not installed. ``shapes`` are
    the model tensors' global shapes (default: the model's state dict, which is global on
    a model not yet sharded); a ``Split`` takes its part sizes from them."""
    if not is_transformers_model(model):
        return {}, set()
    try:
        mapping = _Mapping(model)
    except (ImportError, AttributeError, TypeError):
        return {}, set()
    groups: dict[str, tuple[object, dict[str, list[str]]]] = {}
    renamed: dict[str, str] = {}
    out: dict[str, Composite] = {}
    used: set[str] = set()
    if shapes is None:
        shapes = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    for key in stored:
        name, conv, pattern = mapping.target(key)
        if conv is not None and len(conv.target_patterns) > 1:  # one stored tensor, several targets
            if not wanted & {name.replace(conv.target_patterns[0], t) for t in conv.target_patterns}:
                continue
            path, entry = stored[key]
            parts = _split_targets(conv, key, name, entry, shapes, f"stored tensor {key!r}")
            for target, piece in parts.items():
                out[target] = Composite(piece.source.sizes, (piece,), {key: (path, entry)})
            used.add(key)
            continue
        if name not in wanted:
            continue
        if conv is None:
            renamed[name] = key
        else:
            groups.setdefault(name, (conv, {}))[1].setdefault(pattern, []).append(key)
    for name, key in renamed.items():
        path, entry = stored[key]
        out[name] = Composite(entry.shape, (_whole(key, entry),), {key: (path, entry)})
        used.add(key)
    for name, (conv, by_pattern) in groups.items():
        what = f"model tensor {name!r}"
        collected = {}
        for pattern, keys in by_pattern.items():
            keys.sort(key=_natural)
            _indices_run(keys, what)
            collected[pattern] = [_Virtual(stored[k][1].shape, [_whole(k, stored[k][1])]) for k in keys]
        built = _apply(conv, collected, what)
        dtypes = {stored[p.key][1].dtype for p in built.pieces}
        if len(dtypes) != 1:
            raise CheckpointError(f"{what}: its stored tensors have different dtypes {sorted(dtypes)}")
        out[name] = Composite(built.shape, tuple(built.pieces), {p.key: stored[p.key] for p in built.pieces})
        used.update(p.key for p in built.pieces)
    return out, used


__all__ = ["hub_tensors", "is_transformers_model"]
