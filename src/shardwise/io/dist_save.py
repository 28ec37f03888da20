"""The one skeleton of a distributed save, whatever the format: every rank places its tensors
(``io.placed``), the save's transaction opens (``sink.Saving``), each rank writes its chunks
(the format's part, which says what it wrote: ``{name: {chunk key: checksum}}``), rank 0
gathers the checksums and commits ``shardwise.json`` and the side files beside the data."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

import shardwise.comm as comm
from shardwise._version import __version__
from shardwise.backends import Backend, coordination_group
from shardwise.core.adapter import adapter_for
from shardwise.core.header import dtype_to_str
from shardwise.core.plan import plan_summary
from shardwise.holding import is_dtensor
from shardwise.io.info import ALGORITHM
from shardwise.io.placed import Placed
from shardwise.io.sink import Saving
from shardwise.io.storage import Location
from shardwise.mesh import get_shard_state

if TYPE_CHECKING:
    from shardwise.mesh import AxisMesh

INFO_FORMAT = "shardwise-dcp"  # shardwise.json's "format" for every distributed save


def checkpoint_info(model: nn.Module, placed: Mapping[str, Placed], *, kind: str,
                    metadata: Mapping | None = None) -> dict:
    """The informational ``shardwise.json`` content for a save of ``model``."""
    state = get_shard_state(model)
    dtensors = [t for t in model.state_dict(keep_vars=True).values() if is_dtensor(t)]
    mesh: AxisMesh | None = state.mesh if state is not None else next(
        (t.device_mesh for t in dtensors), None)
    sharded_axes = sorted({(t.device_mesh.mesh_dim_names or ("?",) * t.device_mesh.ndim)[i]
                           for t in dtensors for i, p in enumerate(t.placements) if p.is_shard()})
    return {
        "format": INFO_FORMAT, "version": 1, "kind": kind,
        "shardwise": __version__, "torch": torch.__version__,
        "world_size": comm.world_size(),
        "mesh": None if mesh is None else {"axes": list(mesh.mesh_dim_names or ()),
                                           "shape": list(mesh.mesh.shape)},
        "degree": state.degree if state is not None else 1,
        "holding": state.holding.name if state is not None else None,
        "sharded_axes": sharded_axes,
        "plan": plan_summary(state.specs) if state is not None else {},
        "tensors": {n: {"dtype": dtype_to_str(p.local.dtype), "shape": list(p.shape)}
                    for n, p in placed.items()},
        "metadata": dict(metadata or {}),
        # what sw.save's index metadata would carry (total_parameters), for sw.consolidate
        "index_metadata": (adapter_for(model).index_metadata(model, {n: tuple(p.shape)
                                                                     for n, p in placed.items()})
                           if kind == "model" else {}),
    }


def commit(saving: Saving, info: dict, checksums: dict[str, dict[str, str]], *, backend: Backend | None,
           side_files: Callable[[Location], object] | None = None) -> None:
    """The end of every distributed save, on every rank, once its chunks are written: rank 0
    gathers every rank's ``checksums`` (``{name: {chunk key: checksum}}``, each chunk written by
    one rank) into ``info``'s "checksums" and commits it as ``shardwise.json`` with
    ``side_files(folder)`` beside the data; the folder moves into place."""
    saving.sweeping = False  # from here rank 0 may publish: no rank deletes what was written
    with saving:
        what = f"moving {saving.what} into place"
        everyone = comm.gather_object(checksums, dst=0, group=coordination_group(backend), purpose=what)
        sums: dict = {}
        for part in everyone or ():  # None: not rank 0
            for fqn, chunks in part.items():
                sums.setdefault(fqn, {}).update(chunks)
        saving.commit(info={**info, "checksums": {"algorithm": ALGORITHM, "chunks": sums}} if saving.rank0
                      else None, side_files=side_files)


def model_side_files(model: nn.Module) -> Callable[[Location], object]:
    """What a model's save writes beside its data (a Hugging Face model's config and its kin:
    ``sw.consolidate`` rebuilds the hub layout from them, ``from_pretrained`` reads them)."""
    files = adapter_for(model).write_side_files
    return lambda folder: files(model, folder)


__all__ = ["INFO_FORMAT", "checkpoint_info", "commit", "model_side_files"]
