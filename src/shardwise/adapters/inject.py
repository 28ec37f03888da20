"""PEFT's own LoRA layers in a sharded model. :func:`inject` runs PEFT's injection on a meta view
of every planned base (its global shape), so each LoRA tensor is declared with its global shape,
and undoes it on any failure; :func:`install` puts this rank's shards in and :func:`wire` gives
each LoRA forward the collectives of its base's style (Megatron's conjugate pairs, as local
holding does for the base). Merge and unmerge run PEFT's own code on the shards (no collective);
:func:`keep_for_unmerge` keeps the touched shards so that the last unmerge restores them bit for bit."""

from __future__ import annotations

import types
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.adapters.experts import global_counts, is_param_wrapper, owner_path, wire_experts
from shardwise.adapters.layout import expert_lora_specs, lora_specs
from shardwise.core.spec import ShardSpec, check_shardable, global_shape
from shardwise.errors import CheckpointError
from shardwise.holding import is_dtensor, local_of
from shardwise.local_tp import _CopyTo, _GatherFrom, _ReduceFrom, _SplitTo, run_on_local_params
from shardwise.mesh import ShardState

# (LoRA layer attribute, file key's leaf, model name's leaf, A or B)
_PARTS = (("lora_A", "lora_A.weight", "weight", "A"), ("lora_B", "lora_B.weight", "weight", "B"),
          ("lora_embedding_A", "lora_embedding_A", None, "A"),
          ("lora_embedding_B", "lora_embedding_B", None, "B"))
FILE_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraTensor:
    """One LoRA tensor of one adapter: its layer's ``path``, its file ``key`` (``prefix`` + path +
    leaf), the container attribute (``lora_A``...), its global ``shape`` and ``spec``, its base's
    kind and its ``leaf`` name in a file (``lora_A.weight``)."""

    path: str
    key: str
    part: str
    shape: tuple[int, ...]
    spec: ShardSpec
    kind: str
    leaf: str

    def peft_key(self) -> str:
        """The key PEFT's ``save_pretrained`` gives this tensor."""
        return f"{FILE_PREFIX}{self.path}.{self.leaf}"

    def holder(self, model: nn.Module, adapter: str) -> tuple[Any, str]:
        """``(object, attribute)`` that holds this tensor as a Parameter."""
        container = getattr(model.get_submodule(self.path), self.part)
        if isinstance(container, nn.ParameterDict):
            return container, adapter
        return container[adapter], "weight"


def _planned_bases(model: nn.Module, state: ShardState) -> list[tuple[nn.Module, str]]:
    """Every planned module's base (under a LoRA layer already there: its base layer) with its path."""
    out = []
    for path in state.specs.styles:
        module: Any = model.get_submodule(path)
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        out.append((base, path))
    return out


def inject(model: nn.Module, config, name: str, state: ShardState, *,
           prefix: str = FILE_PREFIX) -> tuple[list[LoraTensor], Any]:
    """Inject adapter ``name`` (``config``, a ``LoraConfig``) with PEFT, its tensors on meta at their
    global shapes (file keys ``prefix`` + module path + leaf); return them and an undo function.
    Raises ``CheckpointError`` (the model as it was) when PEFT cannot, or the layout cannot be
    followed."""
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    children = [(parent, key, child) for parent in model.modules() for key, child in parent._modules.items()]
    layers_before = {id(m): m._active_adapter for m in model.modules() if isinstance(m, LoraLayer)}
    had_config = model.__dict__.get("peft_config", None)
    had_config = None if had_config is None else dict(had_config)  # PEFT adds to the model's dict in place

    def undo() -> None:
        for m in model.modules():
            if isinstance(m, LoraLayer) and id(m) in layers_before:
                m.delete_adapter(name)
                m._active_adapter = layers_before[id(m)]
        for parent, key, child in children:
            parent._modules[key] = child
        if had_config is None:
            model.__dict__.pop("peft_config", None)
        else:
            model.__dict__["peft_config"] = had_config

    # PEFT sizes a LoRA pair from its base's weight (an expert tensor's, for target_parameters):
    # show it the global shape, on meta.
    swapped = []
    for base, path in _planned_bases(model, state):
        for pname, weight in list(base._parameters.items()):
            spec = state.specs.spec_of(f"{path}.{pname}")
            if weight is None or (pname != "weight" and spec.replicated):
                continue
            shape = tuple(weight.shape) if is_dtensor(weight) else global_shape(weight.shape, spec,
                                                                                state.coords(spec)[0])
            base._parameters[pname] = nn.Parameter(torch.empty(shape, dtype=weight.dtype, device="meta"),
                                                   requires_grad=weight.requires_grad)
            swapped.append((base, pname, weight))
    try:
        with warnings.catch_warnings(), global_counts(model):
            warnings.simplefilter("ignore")  # "Already found a peft_config": several adapters are the point
            inject_adapter_in_model(config, model, adapter_name=name, low_cpu_mem_usage=True)
    except Exception as e:
        undo()
        raise CheckpointError(f"adapter {name!r} does not fit this model: {e}") from e
    finally:
        for base, pname, weight in swapped:
            base._parameters[pname] = weight
    model.__dict__["peft_config"] = {**(had_config or {}), name: config}
    if layers_before:  # as PeftModel.load_adapter: a second adapter is loaded, not activated
        active = next(iter(layers_before.values()))
        for m in model.modules():
            if isinstance(m, LoraLayer):
                m.set_adapter(active)
    try:
        return _tensors(model, name, state, prefix), undo
    except Exception:
        undo()
        raise


def _tensors(model: nn.Module, name: str, state: ShardState, prefix: str) -> list[LoraTensor]:
    from peft.tuners.lora import LoraLayer

    out = []
    for path, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        base = layer.get_base_layer()
        kind = "embedding" if isinstance(base, nn.Embedding) else "linear"
        style = state.specs.styles.get(path)
        if is_param_wrapper(layer):  # target_parameters: an expert tensor of the module it wraps
            if name not in layer.r:
                continue
            kind, target = "param", f"{owner_path(path)}.{layer.parameter_name}"
            specs = expert_lora_specs(state.specs.spec_of(target), layer.r[name], where=target)
        elif style is not None and style.sharded and not isinstance(base, (nn.Linear, nn.Embedding)):
            raise CheckpointError(f"adapter {name!r}: LoRA on {path!r} ({type(base).__name__}), a sharded "
                                  "module that is neither nn.Linear nor nn.Embedding, is not supported; "
                                  "leave it out of target_modules")
        else:
            specs = lora_specs(kind, style, state.specs.spec_of(f"{path}.weight"), where=path)
        for part, leaf, _, ab in _PARTS:
            container = getattr(layer, part, None)
            if container is None or name not in container:
                continue
            t = container[name] if isinstance(container, nn.ParameterDict) else container[name].weight
            check_shardable(tuple(t.shape), specs[ab], state.coords(specs[ab])[0])
            key = f"{prefix}{path}.{leaf}"
            out.append(LoraTensor(path, key, part, tuple(t.shape), specs[ab], kind, leaf))
    if not out:
        raise CheckpointError(f"adapter {name!r} adapts no module of this model; check its target_modules")
    return out


def install(model: nn.Module, name: str, tensors: list[LoraTensor], locals_: dict[str, torch.Tensor],
            state: ShardState) -> None:
    """Put each rank's local shard in place of the meta tensor (a DTensor where the base is one)."""
    for t in tensors:
        owner, attr = t.holder(model, name)
        old = getattr(owner, attr)
        local = locals_[t.key]
        layer: Any = model.get_submodule(t.path)
        if t.kind != "param" and is_dtensor(layer.get_base_layer().weight):  # expert pairs: plain (experts)
            from torch.distributed.tensor import DTensor, Replicate, Shard

            placement = Replicate() if t.spec.dim is None else Shard(t.spec.dim)
            mesh: Any = state.axis_mesh(t.spec)  # a DTensor holding's meshes are torch's
            local = DTensor.from_local(local, mesh, [placement], run_check=False)
        param = nn.Parameter(local, requires_grad=old.requires_grad)
        if isinstance(owner, nn.ParameterDict):
            owner[attr] = param
        else:
            owner._parameters[attr] = param


def wire(model: nn.Module, name: str, tensors: list[LoraTensor], state: ShardState) -> None:
    """Make adapter ``name``'s forward right on the shards: its tensors' collectives follow the base."""
    for path, spec in {t.path: t.spec for t in tensors}.items():
        layer: Any = model.get_submodule(path)
        style = state.specs.styles.get(path)
        keep_for_unmerge(layer)
        if is_param_wrapper(layer):
            wire_experts(layer, 1 if spec.replicated else state.coords(spec)[0])  # whole experts: all here
            continue
        dtensor = is_dtensor(layer.get_base_layer().weight)
        if isinstance(layer.get_base_layer(), nn.Embedding):
            if dtensor or (style is not None and style.sharded):
                _wire_embedding(layer, style, state, dtensor)
            continue
        a, b = layer.lora_A[name], layer.lora_B[name]
        if dtensor:
            run_on_local_params(a)
            run_on_local_params(b)
        if style is not None and style.sharded and not state.specs.spec_of(f"{path}.weight").replicated:
            _wire_linear(a, b, style, state)


def _wire_linear(a: nn.Module, b: nn.Module, style, state: ShardState) -> None:
    """The collectives around ``lora_A`` / ``lora_B`` of a linear base held by ``style``."""
    blocks, group = style.blocks or (1,), state.group
    if style.kind == "colwise":
        # lora_A whole, its output the same on every rank: that output's gradient sums over tp
        _around(a, post=lambda y: _CopyTo.apply(y, group))
        if style.gather_output:
            _around(b, post=lambda y: _GatherFrom.apply(y, group, blocks, state.degree, state.tp_rank))
        return
    pre = ((lambda x: _SplitTo.apply(x, group, blocks, state.degree, state.tp_rank))
           if style.split_input else None)
    _around(a, pre=pre, post=lambda y: _ReduceFrom.apply(y, group))  # partial sums of the r features


def _around(module: nn.Module, *, pre=None, post=None) -> None:
    inner = module.forward

    def forward(x):
        y = inner(pre(x) if pre is not None else x)
        return post(y) if post is not None else y

    module.__dict__["forward"] = forward


def _wire_embedding(layer: Any, style, state: ShardState, dtensor: bool) -> None:
    """A vocab-parallel embedding's LoRA: ``lora_embedding_A`` split on the vocab dim, looked up
    with this rank's ids as the base is, the partial rows summed over tp. Once per layer."""
    if getattr(layer, "_shardwise_wired", False):
        return
    layer._shardwise_wired = True
    sharded = style is not None and style.sharded

    def embed(self, ids, weight, input_fn=None, output_fn=None):
        if not sharded:
            return F.embedding(ids, weight, self.get_base_layer().padding_idx)
        rows = weight.shape[0]
        start = state.tp_rank * rows
        outside = (ids < start) | (ids >= start + rows)
        y = F.embedding((ids - start).masked_fill(outside, 0), weight)
        return _ReduceFrom.apply(y.masked_fill(outside.unsqueeze(-1), 0), state.group)

    layer._embed = types.MethodType(embed, layer)
    if dtensor:  # PEFT reads the ParameterDicts inside its forward: hand it their local tensors
        inner = layer.forward

        def forward(*args, **kwargs):
            dicts = (layer.lora_embedding_A, layer.lora_embedding_B)
            held = [(d, k, p) for d in dicts for k, p in d._parameters.items() if is_dtensor(p)]
            for d, k, p in held:
                d._parameters[k] = p.to_local()
            try:
                return inner(*args, **kwargs)
            finally:
                for d, k, p in held:
                    d._parameters[k] = p

        layer.forward = forward


def keep_for_unmerge(layer: Any) -> None:
    """Wrap ``layer.merge`` / ``unmerge`` (PEFT's, on the shards): the first merge keeps a copy of
    the base's local shards, and the unmerge that leaves nothing merged copies them back, so the
    base is bit for bit what it was (PEFT's subtraction is not, in bf16). Once per layer."""
    if getattr(layer, "_shardwise_keeps", False):
        return
    layer._shardwise_keeps = True
    merge, unmerge = layer.merge, layer.unmerge
    only = getattr(layer, "parameter_name", None)  # a ParamWrapper merges into that one parameter

    def kept_merge(*args, **kwargs):
        base = layer.get_base_layer()
        if not layer.merged:
            layer._shardwise_base = {n: local_of(p).detach().clone()
                                     for n, p in base.named_parameters(recurse=False) if only in (None, n)}
        merge(*args, **kwargs)
        if not layer.merged:
            layer.__dict__.pop("_shardwise_base", None)

    def kept_unmerge(*args, **kwargs):
        unmerge(*args, **kwargs)
        kept = layer.__dict__.get("_shardwise_base")
        if kept is not None and not layer.merged:
            base = layer.get_base_layer()
            with torch.no_grad():
                for n, p in base.named_parameters(recurse=False):
                    if n in kept:
                        local_of(p).copy_(kept[n])
            del layer.__dict__["_shardwise_base"]

    layer.merge = kept_merge
    layer.unmerge = kept_unmerge


__all__ = ["FILE_PREFIX", "LoraTensor", "inject", "install", "keep_for_unmerge", "wire"]
