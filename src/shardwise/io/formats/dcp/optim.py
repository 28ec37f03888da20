"""Optimizer state as a canonical distributed checkpoint, keyed by parameter names (torch's
flattened optimizer state dict): a state tensor shaped like its parameter is split like it, so
it reshards on load like the model; scalars and hyperparameters are stored once. Under SPMD a
state tensor is global, saved as this process's shards and loaded a window at a time."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from shardwise.core.spec import ShardSpec
from shardwise.errors import CheckpointError
from shardwise.holding import is_dtensor
from shardwise.io.dist_save import checkpoint_info
from shardwise.io.formats import checkpoint_files
from shardwise.io.formats.dcp.checkpoint import AsyncSave, read_checkpoint, write_checkpoint
from shardwise.io.formats.dcp.metadata import check_tensors, read_metadata
from shardwise.io.formats.dcp.spmd import SpmdSavePlanner, chunks_to_devices, global_placed, host_placed
from shardwise.io.placed import Placed, place
from shardwise.io.read.reader import WINDOW_BYTES
from shardwise.io.storage import locate, target_path
from shardwise.mesh import get_shard_state, world_backend

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import OptimizerStateType, ValueType

_STATE = "state."


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _get_flat(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, ValueType]:
    """torch's flattened optimizer state dict (torch types its result as the nested form)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.tensor.experimental import implicit_replication

    # torch initialises a fresh optimizer's state by stepping it with zero gradients: with foreach
    # (a device's default) over DTensor shards beside plain replicated parameters that step
    # refuses the mix unless the plain ones count as replicated (found on an H200)
    with implicit_replication():
        osd = get_optimizer_state_dict(model, optimizer, options=_options())
    return cast("dict[str, ValueType]", osd)


def _split(model: nn.Module, params: Mapping[str, torch.Tensor], key: str, value: torch.Tensor, *,
           strict: bool = True) -> tuple[ShardSpec | None, int, int]:
    """``(spec, degree, rank)`` ``place`` splits the state tensor ``value`` under ``key`` by: its
    parameter's when shaped like it (spec None without shard state: a DTensor's placements
    say), else ``(ShardSpec(), 1, 0)``: held whole (a scalar such as ``step``, or the state of
    an unsharded parameter). ``strict``: raise ``CheckpointError`` for a tensor of another shape
    than its sharded parameter (an SPMD state is global: held whole)."""
    state = get_shard_state(model)
    pname = key[len(_STATE):].rpartition(".")[0] if key.startswith(_STATE) else None
    param = params.get(pname) if pname is not None else None
    spec = state.specs.get(pname, ShardSpec()) if state is not None and pname is not None else None
    if param is not None and tuple(value.shape) == tuple(param.shape):
        return (spec, *state.coords(spec)) if state is not None and spec is not None else (None, 1, 0)
    if strict and (is_dtensor(value) or (param is not None and value.dim() > 0 and (
            is_dtensor(param) or (spec is not None and not spec.replicated)))):
        raise CheckpointError(
            f"optimizer state {key!r} has shape {tuple(value.shape)}, unlike its sharded "
            f"parameter {tuple(param.shape) if param is not None else ''}; shardwise saves "
            "states shaped like their parameter, or scalars")
    return ShardSpec(), 1, 0


def _placed(model: nn.Module, osd: Mapping) -> dict[str, Placed]:
    """A Placed for every tensor of the flattened optimizer state dict ``osd``."""
    params = dict(model.named_parameters())
    return {key: place(value, *_split(model, params, key, value), name=key)
            for key, value in osd.items() if isinstance(value, torch.Tensor)}


@contextlib.contextmanager
def _gradients_aside(optimizer: torch.optim.Optimizer):
    """Parameters without gradients inside, their gradients back after: torch builds a fresh
    optimizer's state only when no parameter holds a gradient."""
    if optimizer.state:  # built already: torch leaves it alone
        yield
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g


def save_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike, *,
                   overwrite: bool = False, async_save: bool = False,
                   storage_options: dict | None = None) -> AsyncSave | None:
    """Save ``optimizer``'s state and hyperparameters, keyed by ``model``'s parameter names, as a
    canonical DCP checkpoint at ``path`` that reloads under any layout; every rank calls it.
    ``async_save`` and ``storage_options`` work as in ``sw.save``.

    >>> sw.save_optimizer(model, optimizer, "out/optim")   # doctest: +SKIP
    """
    target = target_path(locate(path, storage_options))  # the save's target, decoded once
    osd = _get_flat(model, optimizer)
    planner = None
    state = get_shard_state(model)
    if state is not None and state.holding.one_process:  # global tensors: this process's shards
        backend = state.backend
        assert backend is not None  # an SPMD mesh is made by its backend (xla_spmd)
        backend.settle(list(osd.values()))  # one program for every pending state, not one each
        placed = {k: global_placed(v, backend) for k, v in osd.items() if isinstance(v, torch.Tensor)}
        planner = SpmdSavePlanner(placed, backend)
    else:
        placed = _placed(model, osd)
    info = checkpoint_info(model, placed, kind="optimizer",
                           metadata={"optimizer": type(optimizer).__name__})
    state_dict = {k: placed[k].local if k in placed else v for k, v in osd.items()}
    return write_checkpoint(target, state_dict, placed, info, backend=world_backend(),
                            overwrite=overwrite, replaceable=checkpoint_files(), async_save=async_save,
                            planner=planner)


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike, *,
                   strict: bool = True, storage_options: dict | None = None) -> None:
    """Load the optimizer checkpoint at ``path`` into ``optimizer`` (built over ``model``'s
    parameters in their current layout), resharded like the model, with step counts and
    hyperparameters; every rank calls it. ``strict`` refuses checkpoint entries this optimizer
    has no place for. The ``.metadata`` is a pickle: trust its source.

    >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)   # doctest: +SKIP
    >>> sw.load_optimizer(model, optimizer, "out/optim")            # doctest: +SKIP
    """
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    from torch.distributed.tensor.experimental import implicit_replication

    backend = world_backend()  # the API boundary: the backend of the collectives below
    where = locate(path, storage_options)
    metadata = read_metadata(where)
    # Builds the state (a zero step) when the optimizer has not stepped yet, so there are
    # tensors of the right local shapes to read into.
    with _gradients_aside(optimizer):
        osd = _get_flat(model, optimizer)
    state = get_shard_state(model)
    spmd = state is not None and state.holding.one_process
    if spmd:
        tensors = {k: v for k, v in osd.items() if isinstance(v, torch.Tensor)}
        assert state is not None  # spmd: the model has its shard state
        params = dict(model.named_parameters())
        specs = {k: _split(model, params, k, v, strict=False)[0] or ShardSpec() for k, v in tensors.items()}
        splits = {k: (spec, state.axis_mesh(spec)) for k, spec in specs.items()}
        placed = {k: host_placed(tensors[k], spec, axis) for k, (spec, axis) in splits.items()}
    else:
        placed = _placed(model, osd)
    missing, _ = check_tensors(where, metadata, {k: p.shape for k, p in placed.items()}, strict=False)
    stored = metadata.state_dict_metadata
    missing += [k for k in osd if k not in placed and k not in stored]
    if missing:
        raise CheckpointError(f"{where}: {len(missing)} optimizer entries missing from the checkpoint: "
                              f"{', '.join(missing[:10])}; load the optimizer checkpoint of this model "
                              "and optimizer")
    extra = [k for k in stored if k not in osd]
    if extra and strict:
        raise CheckpointError(f"{where}: {len(extra)} checkpoint entries have no place in this optimizer: "
                              f"{', '.join(extra[:10])}; pass strict=False to ignore them")
    if spmd:
        _read_to_devices(where, metadata, osd, placed, splits, backend)
    else:
        state_dict = {k: placed[k].local if k in placed else v for k, v in osd.items()}
        read_checkpoint(where, metadata, state_dict, placed, backend=backend)
        for k, v in state_dict.items():
            if k not in placed:
                osd[k] = v
    # flattened, as _options says (torch types the argument as the nested form)
    with implicit_replication():  # as in _get_flat
        set_optimizer_state_dict(model, optimizer, cast("OptimizerStateType", osd), options=_options())


def _read_to_devices(path, metadata, osd: dict, placed: dict[str, Placed], splits: dict,
                     backend) -> None:
    """Read the SPMD state tensors into their host buffers about ``WINDOW_BYTES`` at a time (one
    collective DCP read per window, the plain values with the first), each window put onto the
    devices (``osd`` updated) before the next is read."""
    plain = [k for k in osd if k not in placed]
    windows, size = [plain], 0
    for k, p in placed.items():
        if size >= WINDOW_BYTES:
            windows.append([])
            size = 0
        windows[-1].append(k)
        size += p.local.numel() * p.local.element_size()
    for keys in windows:
        state_dict = {k: placed[k].local if k in placed else osd[k] for k in keys}
        read_checkpoint(path, metadata, state_dict, {k: placed[k] for k in keys if k in placed},
                        backend=backend)
        for k in keys:
            if k in placed:
                spec, axis = splits[k]
                device = osd[k].device
                osd[k] = chunks_to_devices(placed.pop(k), spec, axis, device, name=k)
            else:
                osd[k] = state_dict[k]


__all__ = ["load_optimizer", "save_optimizer"]
