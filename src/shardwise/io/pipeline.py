"""What every ``sw.load`` path shares, whatever the format it reads (safetensors files,
torch DCP, rank-local sharded safetensors) and however the shards are held: the result type,
matching a checkpoint's keys, shapes and dtypes to the model before any data is read, the
checks that nothing is left on the meta device, and the device and thread count of a load.

The sources (``shardwise.io.formats``: safetensors, sharded, dcp) and the pipeline
(``shardwise.io.load``) import it; it imports only the safetensors plugin's ``checkpoint`` and
``quantized`` modules (key matching pairs FP8 and MXFP4 weights with their scales) and the hub
layout. The device of a load is the decoded mesh's
(``shardwise.mesh.MeshDims.device``). The cast rule is :func:`shardwise.io.staging.loaded_dtype`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn

from shardwise.core.adapter import adapter_for
from shardwise.core.pieces import Composite
from shardwise.core.plan import ResolvedPlan
from shardwise.errors import CheckpointError
from shardwise.io.formats.safetensors.quantized import pair_mxfp4, pair_quantized
from shardwise.io.storage import Location

if TYPE_CHECKING:
    from shardwise.core.header import NamedDtype
    from shardwise.io.formats.safetensors.quantized import Dequantized

_SHOW = 20  # names listed in an error before "... and N more"


@dataclass(frozen=True)
class LoadResult:
    """What one rank's ``sw.load`` did.

    ``missing_keys``: model tensors the checkpoint lacks (non-strict loads only);
    ``unexpected_keys``: checkpoint tensors the model has no place for; ``bytes_read``:
    tensor bytes this rank read from disk; ``seconds``: wall time of the call on this rank;
    ``tensors``: how many tensors were read; ``unused_plan_keys``: plan keys that matched
    nothing in this model (skipped, as transformers skips them).
    """

    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]
    bytes_read: int
    seconds: float
    tensors: int
    unused_plan_keys: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return (f"LoadResult(tensors={self.tensors}, bytes_read={self.bytes_read}, "
                f"seconds={self.seconds:.3f}, missing={len(self.missing_keys)}, "
                f"unexpected={len(self.unexpected_keys)})")


class KeyedCheckpoint(Protocol):
    """What :func:`match_keys` reads of a checkpoint whose tensors are stored under their
    names: the safetensors ``Checkpoint`` (``io.formats.safetensors.checkpoint``) and the
    ``ShardedCheckpoint`` (``io.formats.sharded.checkpoint``). Read only, before any data is."""

    @property
    def root(self) -> Location:
        """The checkpoint's folder: errors name it, and its ``config.json`` says how FP8 and
        MXFP4 tensors are quantized."""
        ...

    @property
    def names(self) -> list[str]:
        """Every stored tensor's name."""
        ...

    def entry(self, name: str) -> tuple[Location, NamedDtype]:
        """Where tensor ``name`` lives (its file, or the folder of a sharded one) and its
        stored dtype and global shape; ``CheckpointError`` for a name it does not hold."""
        ...


def match_keys(model: nn.Module, specs: ResolvedPlan, ckpt: KeyedCheckpoint, *, strict: bool,
               dequantize: bool = False):
    """``({name: (file, entry), Composite or Dequantized}, missing, unexpected)`` for the model
    tensors in ``specs``.

    A tied tensor may be stored under any of its names; a tensor stored in its hub layout
    (transformers' conversion mapping) is a ``Composite`` of stored tensors; one stored FP8
    with block scales into a model tensor of another dtype, or stored as MXFP4 blocks and
    scales, is ``Dequantized`` when ``dequantize``, else refused
    (``io.formats.safetensors.quantized.pair_quantized`` / ``pair_mxfp4``). Raises
    ``CheckpointError`` for a shape that disagrees with the model and, when ``strict``, for
    missing keys.
    """
    names_of: dict[str, list[str]] = {name: [name] for name in specs}
    for alias, kept in specs.aliases.items():
        names_of[kept].append(alias)
    stored = set(ckpt.names)
    state = model.state_dict(keep_vars=True)
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


def check_nothing_left_on_meta(model: nn.Module, specs: ResolvedPlan, missing: list[str]) -> None:
    """Raise before reading if the load would leave a tensor on the meta device."""
    state = model.state_dict(keep_vars=True)
    empty = [n for n in missing if state[n].is_meta]
    if empty:
        raise CheckpointError(
            f"{len(empty)} tensor(s) missing from the checkpoint have no value in the model (meta "
            f"device): {listing(empty)}; load a checkpoint that has them, or build the model with "
            "these tensors materialised"
        )
    for name, buf in model.named_buffers():
        if name not in state and buf.is_meta:
            raise CheckpointError(
                f"non-persistent buffer {name!r} is on the meta device; checkpoints never store "
                "non-persistent buffers, so loading cannot fill it. Build the model inside "
                "`with sw.empty_model():` (parameters on meta, buffers real) instead of "
                "`with torch.device('meta'):`, or use sw.from_pretrained for Hugging Face models"
            )


def move_non_persistent(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            buf = module._buffers.get(name)
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a tensor outside the state dict (a custom state_dict hook hides it)
        raise CheckpointError(
            f"after loading, {listing(left)} are still on the meta device: the model's state_dict "
            "does not list them, so no checkpoint can fill them; materialise them before sw.load"
        )



def reader_threads(asked: int | None) -> int:
    """The reader threads of a load: ``asked``, else ``min(8, cpus / ranks on this host)``."""
    if asked is not None:
        return asked
    # The ranks on this host share its cores (torchrun and sw.launch set LOCAL_WORLD_SIZE).
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    return max(1, min(8, (os.cpu_count() or 1) // local_ranks))


def listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOW])
    return shown + (f", ... and {len(names) - _SHOW} more" if len(names) > _SHOW else "")


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


__all__ = [
    "KeyedCheckpoint", "LoadResult", "check_dtype", "check_nothing_left_on_meta", "is_rank0", "listing",
    "match_keys", "move_non_persistent", "reader_threads",
]
