"""LoRA adapters on a model shardwise loaded or parallelised: :func:`load_adapter` reads a PEFT
folder (``adapter_config.json`` + ``adapter_model.safetensors``), each rank only its slices of each
LoRA tensor, into PEFT's own LoRA layers; :func:`save_adapter` writes one back. PEFT's API works
on the result (``set_adapter``, ``disable_adapter``, ``delete_adapter``, several adapters, layer
``merge()`` / ``unmerge()``); ``sw.save`` of such a model writes its base (merged, if merged).

>>> sw.load_adapter(model, "lora/", adapter_name="style")        # doctest: +SKIP
AdapterResult(adapter='style', tensors=28, bytes_read=57344)
>>> sw.save_adapter(model, "out/lora", adapter_name="style")     # doctest: +SKIP
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import shardwise.comm as comm
from shardwise.adapters import inject as lora
from shardwise.adapters.inject import FILE_PREFIX
from shardwise.core.spec import assemble, local_layout, local_shape
from shardwise.errors import CheckpointError, UsageError
from shardwise.holding import is_dtensor
from shardwise.io.formats.safetensors.checkpoint import resolve_checkpoint
from shardwise.io.read.mapped import read_region
from shardwise.io.sink import Saving
from shardwise.io.storage import Handles, Location, locate, read_json, target_path
from shardwise.mesh import ShardState, get_shard_state, world_backend

_ATTACHED = "_shardwise_adapters"  # model.__dict__: {adapter name: (config, [LoraTensor])}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"  # diffusers' save_lora_weights


@dataclass(frozen=True)
class AdapterResult:
    """What one rank's ``load_adapter`` did: ``tensors`` (LoRA tensors installed) and
    ``bytes_read`` (bytes of them this rank read: its slices and the whole tensors it holds)."""

    adapter: str
    tensors: int
    bytes_read: int


def attached(model: nn.Module) -> dict[str, Any]:
    """The adapters :func:`load_adapter` put in ``model``, by name (empty: none)."""
    return model.__dict__.get(_ATTACHED, {})


def _lora_config(data: dict, where) -> Any:
    """A ``LoraConfig`` of ``data``; ``CheckpointError`` for what a sharded model cannot take yet."""
    from peft import LoraConfig

    if data.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{where}: peft_type {data.get('peft_type')!r} is not supported; only LORA "
                              "adapters load (convert others with PEFT first)")
    unsupported = {"use_dora": "DoRA", "lora_bias": "LoRA biases",
                   "modules_to_save": "modules_to_save (whole trained copies)",
                   "trainable_token_indices": "trainable tokens", "fan_in_fan_out": "fan_in_fan_out (Conv1D)"}
    for field, what in unsupported.items():
        if data.get(field):
            raise CheckpointError(f"{where}: {what} ({field}={data[field]!r}) is not supported yet on a "
                                  "sharded model; merge it on one process, or train the adapter without it")
    return LoraConfig.from_peft_type(**{**data, "peft_type": "LORA"})


def _diffusers_config(ckpt, file, component: str) -> Any:
    """The ``LoraConfig`` of a diffusers LoRA file's ``component``: from the metadata diffusers'
    ``save_lora_weights`` writes, else read off the tensors (``r`` from each ``lora_A``, alpha = r:
    diffusers' own default without alphas)."""
    prefix = f"{component}."
    names = [n for n in ckpt.names if n.startswith(prefix)]
    if not names:
        found = sorted({n.split(".", 1)[0] for n in ckpt.names})
        raise CheckpointError(f"{file}: no tensor of component {component!r} (found {found}); pass "
                              "component= one of those")
    odd = [n for n in names if not n.endswith((".lora_A.weight", ".lora_B.weight"))]
    if odd:
        raise CheckpointError(f"{file}: {odd[0]!r} is not in PEFT's key format (lora_A / lora_B): a "
                              "community layout; load it once with diffusers' load_lora_weights and save it "
                              "with save_lora_weights, which converts it")
    metadata = ckpt.headers[file].metadata.get("lora_adapter_metadata")
    if metadata is not None:
        packed = json.loads(metadata)
        return _lora_config({k[len(prefix):]: v for k, v in packed.items() if k.startswith(prefix)}, file)
    ranks = {n[len(prefix):-len(".lora_A.weight")]: ckpt.entry(n)[1].shape[0]
             for n in names if n.endswith(".lora_A.weight")}
    r = max(set(ranks.values()), key=list(ranks.values()).count)
    pattern = {m: k for m, k in ranks.items() if k != r}
    return _lora_config({"r": r, "lora_alpha": r, "target_modules": sorted(ranks), "rank_pattern": pattern,
                         "alpha_pattern": pattern}, file)


def _open_adapter(where, component: str):
    """``(config, checkpoint, key prefix)`` of the adapter at ``where``: a PEFT folder, or a
    diffusers LoRA file (or a folder holding ``pytorch_lora_weights.safetensors``)."""
    if where.suffix != ".safetensors" and (where / CONFIG_FILE).exists():
        config = _lora_config(read_json(where / CONFIG_FILE, what=CONFIG_FILE), where)
        return config, resolve_checkpoint(where / WEIGHTS_FILE), FILE_PREFIX
    file = where if where.suffix == ".safetensors" else where / DIFFUSERS_FILE
    if not file.exists():
        raise CheckpointError(f"{where}: neither a PEFT folder ({CONFIG_FILE} + {WEIGHTS_FILE}) nor a "
                              f"diffusers LoRA file ({DIFFUSERS_FILE})")
    ckpt = resolve_checkpoint(file)
    return _diffusers_config(ckpt, file, component), ckpt, f"{component}."


def _read(ckpt, handles, t, coords: tuple[int, int], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """This rank's shard of ``t`` read region by region from the bytes that hold it; bytes read."""
    path, entry = ckpt.entry(t.key)
    out = torch.empty(local_shape(t.shape, t.spec, coords[0]), dtype=entry.torch_dtype)
    nbytes = 0
    for region, off in local_layout(t.shape, t.spec, *coords):
        dest = out[tuple(slice(o, o + s) for o, s in zip(off, region.sizes, strict=True))]
        buf = dest if dest.is_contiguous() else torch.empty(region.sizes, dtype=entry.torch_dtype)
        nbytes += read_region(handles.get(path), ckpt.headers[path], entry, region.offsets, region.sizes, buf)
        if buf is not dest:
            dest.copy_(buf)
    return out.to(dtype), nbytes


def _state(model: nn.Module, what: str) -> ShardState:
    state = get_shard_state(model)
    if state is None:
        raise UsageError(f"{what} needs a model that shardwise loaded or parallelised (sw.load, "
                         "sw.from_pretrained, sw.parallelize); for a model on one process use PEFT itself")
    return state


def load_adapter(model: nn.Module, path: str | os.PathLike | Location, *, adapter_name: str = "default",
                 dtype: torch.dtype | None = None, component: str = "transformer",
                 storage_options: dict | None = None) -> AdapterResult:
    """Attach the LoRA adapter at ``path`` to ``model`` as ``adapter_name``, in PEFT's own LoRA
    layers; every rank calls it. ``path`` (local or a registered storage's URL): a PEFT folder
    (``adapter_config.json`` + ``adapter_model.safetensors``), or a diffusers LoRA file as
    ``save_lora_weights`` writes it (a ``.safetensors`` file or a folder holding
    ``pytorch_lora_weights.safetensors``; ``component``: whose keys to take). Each LoRA tensor
    follows its base's shard spec, and each rank reads only its slices. ``dtype``: of the LoRA
    tensors (None: PEFT's choice, the base weights' dtype). An adapter for another base (a
    missing module, a wrong shape), an adapter type not supported yet (DoRA, ...) or a name
    already attached raise before any tensor is read, and leave the model as it was.

    >>> sw.load_adapter(model, "lora/", adapter_name="style")        # doctest: +SKIP
    AdapterResult(adapter='style', tensors=28, bytes_read=57344)
    """
    state = _state(model, "load_adapter")
    if adapter_name in attached(model) or adapter_name in (model.__dict__.get("peft_config") or {}):
        raise UsageError(f"an adapter named {adapter_name!r} is attached already; pass another adapter_name "
                         "or delete it first")
    where = locate(path, storage_options)
    config, ckpt, prefix = _open_adapter(where, component)
    tensors, undo = lora.inject(model, config, adapter_name, state, prefix=prefix)
    try:
        _check_keys(tensors, ckpt, where, prefix)
        locals_, nbytes = {}, 0
        handles = Handles()
        try:
            for t in tensors:
                owner, attr = t.holder(model, adapter_name)
                want = dtype or getattr(owner, attr).dtype
                locals_[t.key], n = _read(ckpt, handles, t, state.coords(t.spec), want)
                nbytes += n
        finally:
            handles.close()
        lora.install(model, adapter_name, tensors, locals_, state)
        lora.wire(model, adapter_name, tensors, state)
    except Exception:
        undo()
        raise
    model.__dict__.setdefault(_ATTACHED, {})[adapter_name] = (config, tensors)
    if hasattr(model, "_hf_peft_config_loaded"):  # transformers' and diffusers' adapter API on the model
        model.__dict__["_hf_peft_config_loaded"] = True
    return AdapterResult(adapter_name, len(tensors), nbytes)


def _check_keys(tensors, ckpt, where, prefix: str) -> None:
    wanted = {t.key: t.shape for t in tensors}
    # PEFT saves a targeted embedding's base weights beside its LoRA pair (save_embedding_layers):
    # the base comes from the base checkpoint, so they are not read (nested expert wrappers' LoRA
    # tensors sit under base_layer too: those are)
    stored = {n for n in ckpt.names if n.startswith(prefix)
              and (".base_layer." not in n or "lora_" in n.rpartition(".base_layer.")[2])}
    missing = sorted(set(wanted) - stored)
    unexpected = sorted(stored - set(wanted))
    if missing or unexpected:
        raise CheckpointError(f"{where}: the adapter does not match the LoRA layers its config makes in this "
                              f"model: missing {missing[:4]} ({len(missing)}), unexpected {unexpected[:4]} "
                              f"({len(unexpected)}); is it an adapter for another base model?")
    for key, shape in wanted.items():
        got = ckpt.entry(key)[1].shape
        if tuple(got) != shape:
            raise CheckpointError(f"{where}: {key!r} has shape {tuple(got)} but this model's layer needs "
                                  f"{shape}; is it an adapter for another base model (or another rank r)?")


def save_adapter(model: nn.Module, path: str | os.PathLike, *, adapter_name: str = "default",
                 overwrite: bool = False, storage_options: dict | None = None) -> None:
    """Write adapter ``adapter_name`` of ``model`` as a PEFT folder that
    ``PeftModel.from_pretrained`` loads: each LoRA tensor gathered over its axis, rank 0 writes.
    Every rank calls it. Written aside and moved into place once complete (the storage's save
    transaction, as ``sw.save``), so a failed or killed save leaves nothing at ``path``; an
    existing non-empty ``path`` is refused, untouched, unless ``overwrite=True``, which replaces
    a PEFT adapter folder (its config and weights) once the new one is complete, and still
    refuses a folder holding anything else.

    >>> sw.save_adapter(model, "out/lora", adapter_name="style")     # doctest: +SKIP
    """
    state = _state(model, "save_adapter")
    if adapter_name not in attached(model):
        raise UsageError(f"no adapter named {adapter_name!r} was loaded with sw.load_adapter; attached: "
                         f"{sorted(attached(model))}")
    config, tensors = attached(model)[adapter_name]
    # every rank, before the gathers: a refusal costs no collective
    where = target_path(locate(path, storage_options))
    if not overwrite and where.is_folder() and where.list():
        raise CheckpointError(f"save_adapter: {where} exists and is not empty (a previous adapter?); "
                              "pass overwrite=True to replace the adapter there once the new one is "
                              "complete, or another path")
    whole = {}
    for t in tensors:
        owner, attr = t.holder(model, adapter_name)
        local = _model_shard(getattr(owner, attr)).detach().contiguous()
        degree = state.coords(t.spec)[0]
        if t.spec.replicated or degree == 1:
            whole[t.peft_key()] = local
            continue
        parts = [torch.empty_like(local) for _ in range(degree)]
        comm.all_gather_inline(parts, local, group=state.ep_group if t.spec.axis == "ep" else state.group)
        whole[t.peft_key()] = assemble(parts, t.spec, degree)
    what = f"save_adapter {adapter_name!r} to {{target}}"
    with Saving(where, overwrite=overwrite, backend=world_backend(), what=what,
                replaceable=(CONFIG_FILE, WEIGHTS_FILE)) as saving:
        saving.commit(side_files=lambda folder: _write(folder, config, whole))  # rank 0, in the transaction


def _model_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's tp / ep shard of ``param``, whole over the data-parallel mesh dims that FSDP2
    shards it on (``fully_shard`` over a tp-sharded model): gathered over those only."""
    if not is_dtensor(param):
        return param
    names = param.device_mesh.mesh_dim_names or ()
    if not any(n.startswith("dp") for n in names):
        return param.to_local()
    from torch.distributed.tensor import Replicate

    placements = [Replicate() if n.startswith("dp") else p
                  for n, p in zip(names, param.placements, strict=True)]
    return param.redistribute(param.device_mesh, placements).to_local()


def _write(folder, config, tensors: dict[str, torch.Tensor]) -> None:
    import safetensors.torch

    (folder / WEIGHTS_FILE).write_bytes(safetensors.torch.save(tensors, metadata={"format": "pt"}))
    (folder / CONFIG_FILE).write_bytes(_config_text(config))


def _config_text(config) -> bytes:
    fields = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
    return json.dumps(fields, indent=2, sort_keys=True).encode()  # as PeftConfig.save_pretrained writes it


@contextmanager
def base_view(model: nn.Module) -> Iterator[None]:
    """``model`` with each LoRA layer of :func:`load_adapter` replaced by its base layer (merged
    weights if merged), restored on exit: what ``sw.save`` writes of a model with adapters."""
    if not attached(model):
        yield
        return
    from peft.tuners.lora import LoraLayer

    swapped = [(parent, key, child) for parent in model.modules() for key, child in parent._modules.items()
               if isinstance(child, LoraLayer)]
    for parent, key, child in swapped:
        parent._modules[key] = child.get_base_layer()
    try:
        yield
    finally:
        for parent, key, child in swapped:
            parent._modules[key] = child


def saves_base(save):
    """``save`` (``sw.save``) run under :func:`base_view`: a model with adapters saves its base."""

    @functools.wraps(save)
    def wrapper(model: nn.Module, *args, **kwargs):
        with base_view(model):
            return save(model, *args, **kwargs)

    return wrapper


__all__ = ["AdapterResult", "attached", "base_view", "load_adapter", "save_adapter", "saves_base"]
