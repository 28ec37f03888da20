"""Writing a transformers model back in its hub key layout, as region maps.

``save_pretrained`` reverts the model's weight conversions: it writes per-expert tensors
where the module holds one stacked parameter, and ONE fused tensor (``gqkv_proj.weight``,
``gate_up_proj.weight``, a linear attention's ``in_proj``) where the module holds several
(``q_proj``, ``k_proj``, ...). Here each stored tensor becomes a :class:`StoredPart`: the
boxes of model tensors it is assembled from, placed by the load direction's region map
(``hub_layout.hub_tensors``), so save and load share one reading of the conversions and a
save can never write a tensor that the load would not read back into the same places.

Always checked before anything is written (a wrong plan would write a checkpoint that
``verify`` passes and ``from_pretrained`` refuses): every stored tensor has exactly the
name, shape and dtype transformers' own revert gives it, its boxes tile it exactly, and the
boxes of every model tensor tile that tensor exactly.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from shardwise.core.header import TensorEntry, dtype_to_str, str_to_dtype
from shardwise.core.pieces import Composite, Piece, StoredPart, check_tiling
from shardwise.core.spec import Region
from shardwise.errors import CheckpointError, ShardingError
from shardwise.hf.hub_layout import hub_tensors, is_transformers_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from shardwise.io.storage import Location

_MODULE = "save with layout='module' (the model's own tensor names) instead"


def revert(model: nn.Module, meta: dict[str, torch.Tensor],
           fix: str = _MODULE) -> dict[str, torch.Tensor] | None:
    """transformers' ``revert_weight_conversion`` of a transformers ``model``'s meta tensors
    ``meta``: ``{stored key: meta tensor}`` as ``save_pretrained`` writes them; None where
    transformers is not installed. ``CheckpointError`` (ending with ``fix``) when it cannot."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    try:
        return revert_weight_conversion(cast("PreTrainedModel", model), dict(meta))
    except Exception as e:  # noqa: BLE001 - transformers raises anything for a layout it cannot revert
        raise CheckpointError(f"transformers cannot revert {type(model).__name__}'s weight conversions "
                              f"({type(e).__name__}: {e}); {fix}") from e


def hub_save_layout(model: nn.Module,
                    tensors: dict[str, tuple[tuple[int, ...], str]]) -> list[StoredPart] | None:
    """The tensors ``save_pretrained`` would write for ``tensors`` (``{model tensor: (global
    shape, safetensors dtype)}``), in its order; ``None`` when the model has no conversion
    to revert (its module layout is its hub layout).

    transformers' own ``revert_weight_conversion``, run on meta tensors (no data), names the
    stored tensors with their shapes and dtypes; the load direction's region map then places
    the model tensors' boxes in them. Raises ``CheckpointError`` naming the tensor when a
    conversion is not a region map (it transforms values), or when the two directions do
    not agree exactly (shape, dtype, tiling).
    """
    if not is_transformers_model(model):
        return None
    meta = {n: torch.empty(shape, dtype=str_to_dtype(dt), device="meta")
            for n, (shape, dt) in tensors.items()}
    reverted = revert(model, meta)
    if reverted is None or list(reverted) == list(meta):
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
    composites: dict[str, Composite | None] = dict(built)  # None: a tensor under its own name
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
        if key not in fragments and key in tensors and key not in composites \
                and shapes[key] == tuple(t.shape):
            zeros = (0,) * len(t.shape)
            fragments[key] = [(key, Piece(key, Region(zeros, shapes[key]), zeros))]
            composites[key] = None
    unplaced = [k for k in reverted if k not in fragments]
    if unplaced:
        raise CheckpointError(f"the hub layout's {unplaced[:3]} map to no model tensor; {_MODULE}")
    missing = set(tensors) - set(composites)
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
    """``{stored name: (storage id, storage bytes)}`` for the parts that share one storage in
    the state dict ``save_pretrained`` splits: transformers reverts a stack of experts by
    taking views of one tensor (``SplitModulelist``), so the experts of one stacked block
    (same model tensor, same place off the stacked dims) share it; ``itemsize`` is per
    model tensor. Parts that are not stacked have storages of their own (not listed)."""
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



__all__ = ["hub_save_layout", "revert", "shared_storages"]
