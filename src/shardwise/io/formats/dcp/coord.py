"""What the distributed saves share (DCP, ``shardwise.io.formats.dcp.checkpoint``, and rank-local safetensors,
``shardwise.io.formats.sharded.write``): what a model holds (:func:`model_placed`), the
``shardwise.json`` record (:func:`checkpoint_info`); and the coordination around
torch.distributed.checkpoint: its failures as ShardwiseErrors, and the chunk checksums of a
distributed save gathered to rank 0.

DCP reports a failure as ``CheckpointException`` (a BaseException carrying every rank's
exception) and lets a collective whose peer died raise gloo's or NCCL's ``RuntimeError``;
:func:`dcp_error` turns both into errors from ``shardwise.errors`` that name the checkpoint
and every rank's fault (shardwise's own collectives get theirs from ``shardwise.comm``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: name it

import shardwise.comm as comm
from shardwise._version import __version__
from shardwise.backends import Backend, coordination_group
from shardwise.core.adapter import adapter_for
from shardwise.core.header import dtype_to_str
from shardwise.core.plan import plan_summary
from shardwise.errors import CheckpointError, CollectiveError, ShardwiseError
from shardwise.holding import is_dtensor
from shardwise.io.formats.dcp.items import HashingWriter, Placed, place, scale_placed
from shardwise.io.info import ALGORITHM
from shardwise.parallel import get_shard_state

if TYPE_CHECKING:
    from shardwise.backends.group_mesh import AxisMesh

INFO_FORMAT = "shardwise-dcp"


# --- what a model holds -----------------------------------------------------------------

def model_placed(model: nn.Module) -> dict[str, Placed]:
    """``{tensor name: Placed}`` for every parameter and persistent buffer of ``model``, in
    state-dict order; a tied tensor appears once, under its first name."""
    state = get_shard_state(model)
    tensors = model.state_dict(keep_vars=True)
    if state is not None:  # a quantized weight's scales: each block once (dcp.items.scale_placed)
        ties = state.specs.ties
        return {n: scale_placed(tensors[n], ties[n], spec, *state.coords(spec), name=n) if n in ties
                else place(tensors[n], spec, *state.coords(spec), name=n) for n, spec in state.specs.items()}
    seen: set[int] = set()
    out = {}
    for n, t in tensors.items():
        if id(t) not in seen:
            seen.add(id(t))
            out[n] = place(t, None, 1, 0, name=n)
    return out


def checkpoint_info(model: nn.Module, placed: Mapping[str, Placed], *, kind: str,
                    metadata: Mapping | None = None) -> dict:
    """The informational ``shardwise.json`` content for a save of ``model``."""
    state = get_shard_state(model)
    mesh: AxisMesh | None = state.mesh if state is not None else next(
        (t.device_mesh for t in model.state_dict(keep_vars=True).values()
         if is_dtensor(t)), None)
    sharded_axes = sorted({(t.device_mesh.mesh_dim_names or ("?",) * t.device_mesh.ndim)[i]
                           for t in model.state_dict(keep_vars=True).values()
                           if is_dtensor(t)
                           for i, p in enumerate(t.placements) if p.is_shard()})
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


# --- coordination around torch.distributed.checkpoint --------------------------------------


def gather_checksums(writer: HashingWriter, what: str, backend: Backend | None) -> dict:
    """Every rank's chunk checksums (``shardwise.json``'s "checksums"), merged on rank 0;
    every rank calls it, after the data is written. Other ranks get an empty record."""
    everyone = comm.gather_object(writer.checksums, dst=0, group=coordination_group(backend), purpose=what)
    if everyone is None:  # not rank 0
        return {}
    sums: dict = {}
    for part in everyone:
        for fqn, chunks in part.items():
            sums.setdefault(fqn, {}).update(chunks)
    return {"algorithm": ALGORITHM, "chunks": sums}


def dcp_error(path, e: BaseException, what: str) -> ShardwiseError:
    """A ShardwiseError for a failure that ``dcp.save`` / ``dcp.load`` raised: every rank's
    message from a ``CheckpointException`` (a CheckpointError when each rank's failure was
    bad input, such as a corrupt file); a CollectiveError for a collective that failed."""
    if isinstance(e, ShardwiseError):
        return e
    if isinstance(e, CheckpointException):
        failures = {}
        for rank, wrapped in e.failures.items():
            exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            failures[rank] = f"{type(exc).__name__}: {exc}"
        bad_input = all(isinstance(w[0] if isinstance(w, tuple) else w, ValueError)
                        for w in e.failures.values())
        if bad_input:
            detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
            return CheckpointError(f"{path}: {what} failed: {detail}")
        return CollectiveError(f"{path}: {what} failed on rank(s) {sorted(failures)}", failures)
    return CollectiveError(f"{path}: {what} failed: a collective failed, so another rank stopped "
                           f"or died ({type(e).__name__}: {e})")


__all__ = ["INFO_FORMAT", "checkpoint_info", "dcp_error", "gather_checksums", "model_placed"]
