"""Checkpoints in their hub key layout (transformers' per-expert or fused tensors) as region maps
both ways: a model tensor is a ``Composite`` of stored pieces (:func:`hub_tensors`), a stored
tensor a ``StoredPart`` (:func:`hub_save_layout`); a conversion that is no region map is refused."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from shardwise.core.header import NamedDtype, TensorEntry, dtype_to_str, str_to_dtype
from shardwise.core.pieces import Composite, Piece, StoredPart, check_tiling
from shardwise.core.spec import Region
from shardwise.errors import CheckpointError, ShardingError
from shardwise.hf.hub_moves import Virtual, cut, interleave, merge_loop_queries

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from shardwise.io.storage import Location


def _concat(parts: list[Virtual], dim: int, what: str, *, stack: bool = False) -> Virtual:
    """``parts`` concatenated along ``dim``, or stacked on a new ``dim`` (``stack``: each part a
    slab of size 1 there, a dim its pieces' stored tensors lack)."""
    if stack:
        parts = [Virtual(p.shape[:dim] + (1,) + p.shape[dim:],
                          [Piece(q.key, q.source, q.offsets[:dim] + (0,) + q.offsets[dim:],
                                 tuple(sorted((*(d + (d >= dim) for d in q.stacked), dim))))
                           for q in p.pieces]) for p in parts]
    if len({p.shape[:dim] + p.shape[dim + 1:] for p in parts}) != 1:
        shapes = [p.shape for p in parts]
        raise CheckpointError(f"{what}: {'stacked' if stack else 'concatenated'} tensors differ off dim "
                              f"{dim}: {shapes}")
    pieces, start = [], 0
    for part in parts:
        for q in part.pieces:
            offsets = q.offsets[:dim] + (q.offsets[dim] + start,) + q.offsets[dim + 1:]
            pieces.append(Piece(q.key, q.source, offsets, q.stacked))
        start += part.shape[dim]
    shape = parts[0].shape
    return Virtual(shape[:dim] + (start,) + shape[dim + 1:], pieces)


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


def library_of(model: nn.Module | type) -> str | None:
    """``"transformers"``, ``"diffusers"`` or None, from the class hierarchy of ``model`` (a model
    or a class); the library is not imported."""
    cls = model if isinstance(model, type) else type(model)
    bases = {(c.__module__.split(".")[0], c.__name__) for c in cls.__mro__}
    if ("transformers", "PreTrainedModel") in bases:
        return "transformers"
    if ("diffusers", "ModelMixin") in bases:
        return "diffusers"
    return None


def _targets(model: nn.Module) -> Callable[[str], tuple]:
    """transformers' conversions for ``model``, as ``target(stored key)``: ``(model key,
    converter or None, source pattern)``."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(cast("PreTrainedModel", model))  # a transformers model
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None)
    meta = dict.fromkeys(model.state_dict(keep_vars=True))
    # called with the non-converter transforms as the renamings, as transformers' loader does
    rename: Callable[..., tuple[str, str | None]] = rename_source_key

    def target(key: str):
        name, pattern = rename(key, renamings, converters, prefix, meta)
        if pattern is None:
            return name, None, None
        renamed = key
        for r in renamings:
            renamed, _ = r.rename_source_key(renamed)
        for conv in converters:
            _, p = conv.rename_source_key(renamed)
            if p is not None:
                return name, conv, p
        return name, None, None

    return target


def _as_list(v: list[Virtual] | Virtual) -> list[Virtual]:
    return v if isinstance(v, list) else [v]


def _slab(v: Virtual, dim: int, start: int, size: int) -> Virtual:
    """Rows ``[start, start + size)`` of ``dim`` of ``v`` (pieces cut there, rebased)."""
    pieces = []
    for q in v.pieces:
        box = q.box()
        lo, hi = max(box.offsets[dim], start), min(box.offsets[dim] + box.sizes[dim], start + size)
        if lo >= hi:
            continue
        if dim in q.stacked:
            at = q.offsets[:dim] + (lo - start,) + q.offsets[dim + 1:]
            pieces.append(Piece(q.key, q.source, at, q.stacked))
            continue
        sdim = dim - sum(1 for d in q.stacked if d < dim)
        skip = lo - box.offsets[dim]
        src = cut(q.source, sdim, skip, hi - lo)
        pieces.append(Piece(q.key, src, q.offsets[:dim] + (lo - start,) + q.offsets[dim + 1:], q.stacked))
    return Virtual(v.shape[:dim] + (size,) + v.shape[dim + 1:], pieces)


def _apply(conv, groups: dict[str, list[Virtual]], what: str,
           target: tuple[int, ...] | None = None) -> Virtual:
    """Run ``conv``'s operations as geometry over the collected stored tensors; ``target``: the
    model tensor's shape (the rows an ``Inkling2UnpadVocab`` keeps: the first ones)."""
    ops = list(getattr(conv, "operations", []) or [])
    current: Mapping[str, list[Virtual] | Virtual] = groups
    for op in ops:
        name = type(op).__name__
        dim: Any = getattr(op, "dim", None)  # an int on the operations handled below
        if name == "Inkling2UnpadVocab" and not getattr(op, "inverse", False) and target is not None:
            if any(x.shape[0] < target[0] for v in current.values() for x in _as_list(v)):
                raise CheckpointError(f"{what}: {target[0]} rows kept of a stored tensor with fewer")
            current = {p: [_slab(x, 0, 0, target[0]) for x in _as_list(v)] for p, v in current.items()}
        elif name == "Inkling2LoopDequantizeExperts" and len(current) == 1:
            pass  # the values alone, no scales: transformers passes them through unchanged
        elif name == "Interleave":
            current = {p: [interleave(x, dim % len(x.shape), bool(getattr(op, "inverse", False)), what)
                           for x in _as_list(v)] for p, v in current.items()}
        elif name == "Inkling2LoopMergeMessageQueries" and not getattr(op, "inverse", False):
            pair = [_as_list(current.get(p, [])) for p in conv.source_patterns]
            if [len(x) for x in pair] != [1, 1]:
                raise CheckpointError(f"{what}: {name} needs one stored tensor of each of "
                                      f"{conv.source_patterns}")
            current = {"": merge_loop_queries(pair[0][0], pair[1][0], what)}
        elif name == "MergeModulelist":
            current = {p: _concat(_as_list(v), dim, what, stack=True) for p, v in current.items()}
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
    single = _as_list(values[0])
    if len(single) != 1:
        raise CheckpointError(f"{what}: {len(single)} stored tensors for one target and no operation")
    return single[0]


def _whole(key: str, shape: tuple[int, ...]) -> Piece:
    zeros = (0,) * len(shape)
    return Piece(key, Region(zeros, shape), zeros)


def _split_targets(conv, key: str, name: str, entry: NamedDtype, shapes: dict, what: str) -> dict:
    """``{model tensor: its slab}`` for a converter that splits one stored tensor into several
    (``Split``: sizes of the model tensors; ``Chunk``: equal parts), each a slab of it, after
    an ``Interleave`` where one comes first (the slabs' rows then come from both halves)."""
    ops = list(getattr(conv, "operations", []) or [])
    whole = Virtual(tuple(entry.shape), [_whole(key, tuple(entry.shape))])
    if len(ops) == 2 and type(ops[0]).__name__ == "Interleave":
        inverse = bool(getattr(ops[0], "inverse", False))
        whole = interleave(whole, ops[0].dim % len(entry.shape), inverse, what)
        ops = ops[1:]
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
        out[target] = _slab(whole, dim % len(entry.shape), start, size)
        start += size
    return out


def hub_tensors(model: nn.Module, stored: Mapping[str, tuple[Location | None, NamedDtype]],
                wanted: set[str], shapes: dict[str, tuple[int, ...]] | None = None,
                ) -> tuple[dict[str, Composite], set[str]]:
    """``({model tensor: Composite}, stored keys used)`` for the tensors of ``wanted`` that a
    transformers conversion builds from ``stored`` (``{key: (file or None, entry)}``); empty
    without transformers. ``shapes``: global shapes, for a ``Split``'s parts (default: the
    model's state dict, global before sharding)."""
    if library_of(model) != "transformers":
        return {}, set()
    try:
        target_of = _targets(model)
    except (ImportError, AttributeError, TypeError):
        return {}, set()
    groups: dict[str, tuple[object, dict[str, list[str]]]] = {}  # {model tensor: (converter, keys)}
    out: dict[str, Composite] = {}
    used: set[str] = set()
    if shapes is None:
        shapes = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    for key in stored:
        name, conv, pattern = target_of(key)
        if conv is not None and len(conv.target_patterns) > 1:  # one stored tensor, several targets
            if not wanted & {name.replace(conv.target_patterns[0], t) for t in conv.target_patterns}:
                continue
            path, entry = stored[key]
            parts = _split_targets(conv, key, name, entry, shapes, f"stored tensor {key!r}")
            for target, slab in parts.items():
                out[target] = Composite(slab.shape, tuple(slab.pieces), {key: (path, entry)})
            used.add(key)
            continue
        if name not in wanted:
            continue
        if conv is None:  # renamed only: the last stored key of that name
            groups[name] = (None, {"": [key]})
        else:
            groups.setdefault(name, (conv, {}))[1].setdefault(pattern, []).append(key)
    for name, (conv, by_pattern) in groups.items():
        what = f"model tensor {name!r}"
        collected = {}
        for pattern, keys in by_pattern.items():
            keys.sort(key=_natural)
            _indices_run(keys, what)
            collected[pattern] = [Virtual(stored[k][1].shape, [_whole(k, stored[k][1].shape)]) for k in keys]
        built = _apply(conv, collected, what, shapes.get(name))
        dtypes = {stored[p.key][1].dtype for p in built.pieces}
        if len(dtypes) != 1:
            raise CheckpointError(f"{what}: its stored tensors have different dtypes {sorted(dtypes)}")
        out[name] = Composite(built.shape, tuple(built.pieces), {p.key: stored[p.key] for p in built.pieces})
        used.update(p.key for p in built.pieces)
    return out, used


# -- the save direction ------------------------------------------------------------------
_MODULE = "save with layout='module' (the model's own tensor names) instead"


def revert(model: nn.Module, tensors: Mapping[str, tuple[tuple[int, ...], str]],
           fix: str = _MODULE) -> dict[str, torch.Tensor] | None:
    """transformers' ``revert_weight_conversion`` of ``tensors`` (``{model tensor: (global shape,
    safetensors dtype)}``), on meta: ``{stored key: meta tensor}`` as ``save_pretrained`` writes
    them; None for a model not of transformers or where it is not installed. ``CheckpointError``
    (ending with ``fix``) when it cannot."""
    if library_of(model) != "transformers":
        return None
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    meta = {n: torch.empty(shape, dtype=str_to_dtype(dt), device="meta")
            for n, (shape, dt) in tensors.items()}
    try:
        return revert_weight_conversion(cast("PreTrainedModel", model), meta)
    except Exception as e:  # noqa: BLE001 - transformers raises anything for a layout it cannot revert
        raise CheckpointError(f"transformers cannot revert {type(model).__name__}'s weight conversions "
                              f"({type(e).__name__}: {e}); {fix}") from e


def hub_save_layout(model: nn.Module,
                    tensors: dict[str, tuple[tuple[int, ...], str]]) -> list[StoredPart] | None:
    """The stored tensors ``save_pretrained`` writes for ``tensors`` (as :func:`revert`), in its
    order, placed by :func:`hub_tensors`; None: no conversion. ``CheckpointError`` naming the
    tensor where a conversion is no region map or the two directions disagree."""
    reverted = revert(model, tensors)
    if reverted is None or list(reverted) == list(tensors):
        return None
    stored: dict[str, tuple[Location | None, TensorEntry]] = {}  # no file: a layout only
    for key, t in reverted.items():
        nbytes = math.prod(t.shape) * t.dtype.itemsize
        stored[key] = (None, TensorEntry(key, dtype_to_str(t.dtype), tuple(t.shape), 0, nbytes))
    shapes = {n: tuple(shape) for n, (shape, _) in tensors.items()}
    try:
        built, _ = hub_tensors(model, stored, set(tensors), shapes)
    except CheckpointError as e:
        raise CheckpointError(f"sw.save cannot write {type(model).__name__} in its hub layout: {e}; "
                              f"{_MODULE}") from e
    placed = set(built)  # model tensors with a place in the hub layout
    fragments: dict[str, list[tuple[str, Piece]]] = {}
    for name, comp in built.items():
        if comp.shape != shapes[name]:
            raise CheckpointError(f"{name!r}: the hub layout reassembles to {comp.shape}, not "
                                  f"{shapes[name]}; {_MODULE}")
        _tiles(comp.shape, comp.pieces, f"model tensor {name!r} in the hub layout")
        for piece in comp.pieces:
            fragments.setdefault(piece.key, []).append((name, piece))
    for key, t in reverted.items():
        # A key that the load direction renames to no model tensor while it names one itself
        # (DeepSeek-V4's ".norm." -> ".kv_norm." also matches model.norm.weight): the load
        # reads it under its own name, so the save writes it so too.
        if key not in fragments and key in tensors and key not in placed and shapes[key] == tuple(t.shape):
            fragments[key] = [(key, _whole(key, shapes[key]))]
            placed.add(key)
    unplaced = [k for k in reverted if k not in fragments]
    if unplaced:
        raise CheckpointError(f"the hub layout's {unplaced[:3]} map to no model tensor; {_MODULE}")
    missing = set(tensors) - placed
    if missing:
        raise CheckpointError(f"model tensors {sorted(missing)[:3]} have no place in the hub layout; "
                              f"{_MODULE}")
    return [_part(key, stored[key][1], fragments[key], tensors) for key in reverted]


def _part(key: str, entry: TensorEntry, frags: list[tuple[str, Piece]], tensors: dict) -> StoredPart:
    """The stored tensor ``key`` (transformers' revert gave it ``entry``'s shape and dtype),
    checked: its boxes tile it, and every model tensor in it has its dtype."""
    boxes = [Piece(name, p.source, p.source.offsets) for name, p in frags]
    _tiles(entry.shape, boxes, f"stored tensor {key!r} of the hub layout")
    dtypes = {tensors[name][1] for name, _ in frags}
    if dtypes != {entry.dtype}:
        raise CheckpointError(f"stored tensor {key!r} of the hub layout is {entry.dtype} but is made of "
                              f"model tensors of dtype {sorted(dtypes)}; {_MODULE}")
    return StoredPart(key, tuple(entry.shape), entry.dtype, tuple(frags))


def _tiles(shape: tuple[int, ...], pieces, what: str) -> None:
    try:
        check_tiling(shape, pieces, what)
    except ShardingError as e:
        raise CheckpointError(f"{e}; {_MODULE}") from e


def shared_storages(parts: list[StoredPart], itemsize: dict[str, int]) -> dict[str, tuple[object, int]]:
    """``{stored name: (storage id, storage bytes)}`` for the parts ``save_pretrained``'s state
    dict holds as views of one storage (a reverted stack of experts, ``SplitModulelist``: same
    model tensor, same place off the stacked dims); ``itemsize`` per model tensor."""
    groups: dict[object, list[tuple[StoredPart, str, Piece]]] = {}
    for p in parts:
        if len(p.fragments) == 1 and p.fragments[0][1].stacked:
            name, piece = p.fragments[0]
            off = tuple(o for d, o in enumerate(piece.offsets) if d not in piece.stacked)
            groups.setdefault((name, off), []).append((p, name, piece))
    out = {}
    for sid, members in groups.items():
        nbytes = sum(math.prod(piece.source.sizes) for _, _, piece in members) * itemsize[members[0][1]]
        out.update({p.key: (sid, nbytes) for p, _, _ in members})
    return out


__all__ = ["hub_save_layout", "hub_tensors", "library_of", "revert", "shared_storages"]
