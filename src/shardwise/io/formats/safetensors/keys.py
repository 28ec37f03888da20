"""Which stored tensor fills which model tensor, for the formats that store tensors under their
names (safetensors, sharded safetensors): the ``match`` step of their sources. Tied names, the
hub layout and the FP8 / MXFP4 pairings are decided here, once, before any data is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from shardwise.core.adapter import adapter_for
from shardwise.core.pieces import Composite
from shardwise.core.plan import ResolvedPlan
from shardwise.core.walk import state_tensors
from shardwise.errors import CheckpointError
from shardwise.io.formats.safetensors.quantized import pair_mxfp4, pair_quantized
from shardwise.io.storage import Location

if TYPE_CHECKING:
    from shardwise.core.header import NamedDtype
    from shardwise.io.formats.safetensors.quantized import Dequantized

_SHOW = 20  # names listed in an error before "... and N more"


class KeyedCheckpoint(Protocol):
    """What :func:`match_keys` reads of a checkpoint whose tensors are stored under their names
    (``Checkpoint``, ``ShardedCheckpoint``): ``root`` (errors name it; its ``config.json`` says
    how tensors are quantized), every stored tensor's ``names``, and ``entry(name)``: where it
    lives and its stored dtype and global shape (``CheckpointError`` for a name it lacks)."""

    @property
    def root(self) -> Location: ...

    @property
    def names(self) -> list[str]: ...

    def entry(self, name: str) -> tuple[Location, NamedDtype]: ...


def match_keys(model: nn.Module, specs: ResolvedPlan, ckpt: KeyedCheckpoint, *, strict: bool,
               dequantize: bool = False):
    """``({name: (file, entry), Composite or Dequantized}, missing, unexpected)`` for the model
    tensors in ``specs``. A tied tensor may be stored under any of its names; one stored in its
    hub layout is a ``Composite``; one stored FP8 with block scales into another dtype, or as
    MXFP4 blocks and scales, is ``Dequantized`` when ``dequantize``, else refused. Raises
    ``CheckpointError`` for a shape that disagrees with the model and, when ``strict``, for
    missing keys.
    """
    names_of: dict[str, list[str]] = {name: [name] for name in specs}
    for alias, kept in specs.aliases.items():
        names_of[kept].append(alias)
    stored = set(ckpt.names)
    state = state_tensors(model)
    shapes = {n: tuple(t.shape) for n, t in state.items()}
    absent = {n for n, candidates in names_of.items() if not any(c in stored for c in candidates)}
    # A tensor the checkpoint stores as MXFP4 blocks and scales (gpt-oss's experts).
    mxfp4, mxfp4_used = pair_mxfp4(absent, shapes, {n: state[n].dtype for n in absent}, ckpt,
                                   dequantize=dequantize) if absent else ({}, set())
    absent -= set(mxfp4)
    # A tensor the checkpoint stores in its hub layout (renamed, or split per expert).
    hub, used = (adapter_for(model).stored_tensors(model, {k: ckpt.entry(k) for k in ckpt.names}, absent)
                 if absent else ({}, set()))
    sources: dict[str, tuple[Location, NamedDtype] | Composite | Dequantized] = {}
    missing, found_as = [], {}
    for name, candidates in names_of.items():
        found = next((c for c in candidates if c in stored), None)
        if found is None and name in mxfp4:
            continue
        if found is None and name in hub:
            composite = hub[name]
            if composite.shape != shapes[name]:
                raise CheckpointError(
                    f"{ckpt.root}: {name!r} assembles to shape {composite.shape} from the checkpoint's "
                    f"{len(composite.stored)} stored tensor(s) but is {shapes[name]} in the model; load "
                    "a checkpoint of this model's configuration")
            check_dtype(name, composite.entry.torch_dtype, state[name].dtype, where=ckpt.root)
            sources[name] = composite
            continue
        if found is None:
            missing.append(name)
            continue
        file, entry = ckpt.entry(found)
        if entry.shape != shapes[name]:
            raise CheckpointError(
                f"{file}: tensor {found!r} has shape {entry.shape} in the checkpoint but "
                f"{shapes[name]} in the model; load a checkpoint of this model's configuration"
            )
        check_dtype(found, entry.torch_dtype, state[name].dtype, where=file)
        sources[name], found_as[name] = (file, entry), found
    declared = {n: state[n].dtype for n in sources}
    used |= pair_quantized(sources, found_as, declared, ckpt, dequantize=dequantize,
                           quantized=specs.quantized, model_config=getattr(model, "config", None))
    sources |= mxfp4
    used |= mxfp4_used
    unexpected = sorted(stored - set(shapes) - used)
    if missing and strict:
        raise CheckpointError(
            f"{ckpt.root}: {len(missing)} model tensor(s) missing from the checkpoint: "
            f"{listing(missing)}; load the checkpoint that matches this model, or pass "
            "strict=False to keep the model's own values for them"
        )
    return sources, missing, unexpected


def check_dtype(name: str, stored: torch.dtype, declared: torch.dtype, *, where) -> None:
    """Raise ``CheckpointError`` unless a tensor stored as ``stored`` can fill a model tensor
    declared ``declared``: floating point to floating point (cast after slicing), anything
    else only to its own dtype, so no integer or bool is ever reinterpreted or narrowed."""
    if stored == declared or (stored.is_floating_point and declared.is_floating_point):
        return
    raise CheckpointError(
        f"{where}: tensor {name!r} is stored as {stored} but the model declares {declared}; "
        "a checkpoint of another model or a corrupted header? Load the checkpoint written for "
        "this model, or convert that tensor to the declared dtype first"
    )


def listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOW])
    return shown + (f", ... and {len(names) - _SHOW} more" if len(names) > _SHOW else "")


__all__ = ["KeyedCheckpoint", "check_dtype", "listing", "match_keys"]
