"""Put local shards into a model and make its forward correct under tensor parallelism:
:func:`install` is the one place that writes shards into a model (from ``parallelize`` or a
load); the holding then wires the forward (:func:`wire`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

import shardwise.comm as comm
from shardwise.core.plan import ResolvedPlan, Style, resolve_plan, without_tp
from shardwise.core.spec import ShardSpec, split
from shardwise.core.walk import module_table, state_tensors, tensors_changed
from shardwise.errors import NonFiniteError, PlanError
from shardwise.holding import Holding, is_dtensor, local_of  # noqa: F401 - local_of: re-exported
from shardwise.local_tp import run_on_local_params, wire_forward, wire_local
from shardwise.mesh import MeshDims, ShardState, decode_mesh, get_shard_state, set_shard_state, world_backend
from shardwise.plan_checks import check_installed, check_plan, check_unused_keys
from shardwise.quant import guard_cut_blocks, local_part, quantized_module, scale_is_local, wire_quantized

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from shardwise.backends.xla_spmd import SpmdMesh


def resolve_for_mesh(model: nn.Module, plan, dims: MeshDims, ep_plan=None) -> ResolvedPlan:
    """``resolve_plan`` for the tp and ep axes of ``dims``, checked, unused keys warned about once;
    on a mesh without a tp axis its tp part is dropped."""
    specs = resolve_plan(model, plan, dims.degree, ep_plan=ep_plan, ep_degree=dims.ep_degree)
    check_plan(model, specs)  # a forward shaping split heads by the global count
    check_unused_keys(model, specs.unused_keys, ours=not (isinstance(plan, str) and plan == "auto"))
    return without_tp(specs) if dims.tp_mesh is None else specs


def _set_tensor(modules: dict[str, nn.Module], name: str, value: torch.Tensor) -> None:
    prefix, _, leaf = name.rpartition(".")
    module = modules[prefix]
    if leaf in module._parameters:
        old = module._parameters[leaf]
        assert old is not None  # a state-dict name: a None parameter has none
        module._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        raise PlanError(f"{name!r} is neither a parameter nor a buffer of the model")


def install(model: nn.Module, specs: ResolvedPlan, dims: MeshDims, *,
            local_tensor: Callable[[str, ShardSpec], torch.Tensor],
            dtype: torch.dtype | None = None) -> ShardState:
    """Replace every tensor of ``model`` by ``local_tensor(name, spec)``, wire the forward with
    ``dims.holding`` and check every tensor against the model's declared shapes and dtypes.
    Every rank calls it with the same ``specs`` and ``dims`` (no collective)."""
    for axis, degree in (("tp", dims.degree), ("ep", dims.ep_degree)):
        if specs.degrees[axis] != degree:
            raise PlanError(f"plan was resolved for {axis} degree {specs.degrees[axis]} but the mesh "
                            f"{axis} axis has {degree}")
    declared = {n: (tuple(t.shape), t.dtype) for n, t in state_tensors(model).items()}
    modules = module_table(model)
    for name, spec in specs.items():
        _set_tensor(modules, name, local_tensor(name, spec))
    for alias, kept in specs.aliases.items():  # re-tie shared weights to the one new tensor
        prefix, _, leaf = alias.rpartition(".")
        kept_prefix, _, kept_leaf = kept.rpartition(".")
        setattr(modules[prefix], leaf, getattr(modules[kept_prefix], kept_leaf))
    tensors_changed(model)
    state = ShardState.of(dims, specs)
    if not dims.holding.one_process:  # SPMD: the model's own forward, the partitioner adds the collectives
        wire(model, specs, state, dtensor=not dims.holding.plain_shards)
    check_installed(model, specs, declared, holding=dims.holding, dtype=dtype, coords=dims.axis_coords)
    set_shard_state(model, state)
    return state


def check_wiring(model: nn.Module, specs: ResolvedPlan, holding: Holding) -> None:
    """Raise ``PlanError``, before any read, for a planned module ``holding`` cannot wire: under
    plain shards, a sharded nn.Linear subclass with a forward of its own (the local-shard forward
    would skip what it adds). torch's styles and the explicit-collective forwards take the rest."""
    if not holding.plain_shards:
        return
    for path, style in specs.styles.items():
        module = model.get_submodule(path)
        if (style.forward == "linear" and not isinstance(module, nn.Embedding)
                and type(module).forward is not nn.Linear.forward and quantized_module(specs, path) is None):
            raise PlanError(
                f"plan key {specs.keys[path]!r}: {path!r} is a {type(module).__name__}, an nn.Linear "
                f"with a forward of its own, which local holding cannot shard without skipping it; use "
                "holding='dtensor', or plan its submodules instead")


def wire(model: nn.Module, specs: ResolvedPlan, state: ShardState, *, dtensor: bool) -> None:
    """Make the planned modules' forward correct on the installed shards: ``dtensor`` (DTensor
    holding), every sharded parameter a DTensor on its axis mesh, forwards written for plain
    tensors run on their local shards; else (local holding) plain local shards, each planned
    forward doing its collectives."""
    # {id(local Parameter): (that Parameter, its DTensor Parameter)} while wiring, so a tied
    # weight seen from a second module becomes the same DTensor Parameter; under "dtensor specs",
    # the specs dtensor_of shares.
    converted: dict = {}
    modules = module_table(model)
    # Owners of parameters sharded by a parameter key first: their local-shard wrapper is
    # innermost, below any style wrapper (moe_experts) of the same module.
    for path in specs.local_owners if dtensor else ():
        module = modules[path]
        _dtensor_params(module, path, state, converted, sharded_only=True)
        run_on_local_params(module)
    for path, style in specs.styles.items():
        module = modules[path]
        if style.forward != "linear":
            wire_forward(module, style, state)
        elif quantized_module(specs, path) is not None:
            if dtensor:
                _dtensor_params(module, path, state, converted)
            wire_quantized(module, path, style, state)  # its own FP8 kernel, on local shards
        elif dtensor:
            _wire_dtensor(module, path, style, state, converted)
        else:
            wire_local(module, style, state)
    guard_cut_blocks(model, specs)  # FP8 modules whose shards cut blocks: their kernels would be wrong


def parallelize(model: nn.Module, plan, mesh, *, holding: str | None = None, ep_plan=None) -> nn.Module:
    """Shard a materialised ``model`` in place so its forward equals the one-device forward.

    ``plan``: module or parameter paths to styles, or ``"auto"`` (the model's own); ``ep_plan``
    (default: the model's own) shards the experts over an ``ep`` axis. Every rank calls it with
    the same weights. ``holding`` defaults to the active backend's (``"dtensor"`` or ``"local"``).

    >>> backend = sw.init_backend("gloo")                                   # doctest: +SKIP
    >>> sw.parallelize(model, {"mlp.up": "colwise", "mlp.down": "rowwise"},
    ...                backend.mesh(tp=backend.world_size))                 # doctest: +SKIP
    """
    if get_shard_state(model) is not None:
        raise PlanError("model is already parallelised; build a fresh model to apply another plan")
    dims = decode_mesh(mesh, holding)  # the API boundary: the mesh decoded once
    specs = resolve_for_mesh(model, plan, dims, ep_plan)
    full = model.state_dict()
    meta = [n for n in specs if full[n].is_meta]
    if meta:
        raise PlanError(f"parallelize needs a materialised model, but {meta[0]!r} is on the meta "
                        "device; use sw.load(model, path, plan=..., mesh=...) to fill a meta model")
    check_wiring(model, specs, dims.holding)
    # the mesh's device type, not dims.device: a model parallelised over a CPU (gloo) mesh
    # keeps its tensors where they are
    device = torch.device(mesh.device_type) if mesh.device_type != "cpu" else None
    install(model, specs, dims,
            local_tensor=lambda name, spec: _shard(full[name], name, spec, specs, dims, device))
    return model


def _shard(full: torch.Tensor, name: str, spec: ShardSpec, specs: ResolvedPlan, dims: MeshDims,
           device: torch.device | None) -> torch.Tensor:
    """This rank's shard of the model's whole tensor ``full``, on ``device`` (None: as is); under
    SPMD holding the global tensor placed over the devices."""
    t = full.detach()
    if dims.holding.one_process:
        return cast("SpmdMesh", dims.tp_mesh).distribute(t, spec.dim)
    local = t if spec.replicated else local_part(t, name, spec, specs, dims.coords(spec))
    return local.to(device) if device is not None and local.device != device else local


# -- DTensor holding: torch's styles, with our shards as their parameters ---------------
@functools.cache
def _dtensor_api() -> tuple:
    """torch's DTensor names a wiring uses, imported once (an import statement per parameter cost
    a few µs each); the private spec types are None in a torch that moved them."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._utils import compute_global_tensor_info
    except ImportError:  # a torch that moved them: DTensor.from_local, the public way
        return DTensor, Replicate, Shard, None
    return DTensor, Replicate, Shard, (DTensorSpec, TensorMeta, compute_global_tensor_info)


def _dtensor_params(module: nn.Module, prefix: str, state: ShardState, converted: dict, *,
                    sharded_only: bool = False) -> None:
    _, Replicate, Shard, _ = _dtensor_api()
    for pname, p in list(module._parameters.items()):
        if p is None:
            continue
        done = converted.get(id(p))
        spec = state.specs.spec_of(f"{prefix}.{pname}" if prefix else pname)
        if (sharded_only and spec.replicated) or scale_is_local(state.specs, f"{prefix}.{pname}"):
            continue  # a scale whose blocks shard boundaries cut: held local (shardwise.quant)
        if done is None:  # the first module of a tied weight converts it; the others reuse it
            placement = Replicate() if spec.dim is None else Shard(spec.dim)  # None: replicated
            mesh = cast("DeviceMesh", state.axis_mesh(spec))  # a DTensor holding's meshes are torch's
            d = dtensor_of(p.data, mesh, placement, converted.setdefault("dtensor specs", {}))
            done = (p, _as_parameter(d, p.requires_grad))
            converted[id(p)] = done
        if _registration_hooks():
            module.register_parameter(pname, done[1])
        else:  # what register_parameter does to a name it already holds, without its checks
            module._parameters[pname] = done[1]


def dtensor_of(local: torch.Tensor, mesh: DeviceMesh, placement, specs: dict | None = None) -> DTensor:
    """``DTensor.from_local(local, mesh, [placement], run_check=False)`` for a ``local`` that needs
    no gradient, built directly: the same spec (global shape and stride as ``from_local`` computes
    them, evenly sharded), without the autograd Function around it (~45 of its ~65 µs per
    parameter, paid by every sharded parameter of a DTensor-held load). ``specs`` (a dict kept for
    one wiring) shares one spec among the shards of one shape, as torch's sharding propagation
    shares its output specs: building one costs ~20 µs."""
    DTensor, _, _, private = _dtensor_api()
    if private is None or local.requires_grad or local.device.type != mesh.device_type:
        return DTensor.from_local(local, mesh, [placement], run_check=False)
    DTensorSpec, TensorMeta, compute_global_tensor_info = private
    part_of_mesh = getattr(mesh, "_is_current_rank_part_of_mesh", None)
    # torch 2.9 has none: its get_coordinate is None off the mesh
    if not (mesh.get_coordinate() is not None if part_of_mesh is None else part_of_mesh()):
        return DTensor.from_local(local, mesh, [placement], run_check=False)
    placements = (placement,)
    key = (id(mesh), placement, tuple(local.shape), local.stride(), local.dtype)  # meshes live while wiring
    spec = specs.get(key) if specs is not None else None
    if spec is None:
        shape, stride = compute_global_tensor_info(local, mesh, placements)
        meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
        spec = DTensorSpec(mesh, placements, tensor_meta=meta)
        if specs is not None:
            specs[key] = spec
    return DTensor(local.view_as(local), spec, requires_grad=False)


def _as_parameter(d: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """``d`` (a fresh DTensor leaf) marked as a Parameter as ``nn.Parameter(d)`` would, without its
    ``d.detach()``, which runs DTensor's sharding propagation (a load's install paid ~15 ms)."""
    if d.grad_fn is not None:  # not a leaf: let torch make the Parameter its own way
        return nn.Parameter(d, requires_grad=requires_grad)
    d.requires_grad_(requires_grad)
    d._is_param = True  # how torch/nn/parameter.py marks a tensor subclass as a Parameter
    return d if isinstance(d, nn.Parameter) else nn.Parameter(d, requires_grad=requires_grad)


def _registration_hooks() -> bool:
    """Whether a global parameter registration hook is set (then parameters are registered the
    public way, so it sees them)."""
    return bool(getattr(nn.modules.module, "_global_parameter_registration_hooks", True))


def _wire_dtensor(module: nn.Module, path: str, style: Style, state: ShardState, converted: dict) -> None:
    if isinstance(module, nn.Embedding) or type(module).forward is nn.Linear.forward:
        # DTensor parameters, forward on their local shards with explicit (autograd-aware)
        # collectives, as local holding computes: the same outputs and gradients, without
        # DTensor dispatch, whose first call per op and shape costs milliseconds of Python
        # (a model's first forward paid ~0.15 s of it). Linear subclasses keep torch's styles.
        _dtensor_params(module, path, state, converted)
        wire_local(module, style, state)
        run_on_local_params(module)
        return
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    base: type[ColwiseParallel | RowwiseParallel]
    if style.kind == "colwise":
        base = ColwiseParallel
        kwargs = {"output_layouts": Replicate()} if style.gather_output else {}
    else:
        base, kwargs = RowwiseParallel, {}

    class _FromShards(base):  # type: ignore[valid-type,misc]  # a base class chosen at run time
        # torch's styles distribute a full tensor; ours already hold their shard.
        def _partition_linear_fn(self, name, mod, device_mesh):
            # torch calls this for every submodule (name relative to `module`): only the
            # planned module's own parameters are ours.
            if mod is module:
                _dtensor_params(mod, path, state, converted)

    parallelize_module(module, cast("DeviceMesh", state.tp_mesh), _FromShards(**kwargs))
    if style.split_input:
        def split_input(mod, args):
            spec = ShardSpec(dim=args[0].ndim - 1, blocks=style.blocks or (1,))
            return (split(args[0], spec, state.degree, state.tp_rank),) + tuple(args[1:])

        module.register_forward_pre_hook(split_input)


# -- clip_grad_norm_: the true global norm over every mesh a gradient is split on ----------
# torch's clip_grad_norm_ stacks per-tensor norms, which fails (or counts replicated tensors
# once per rank) for DTensors on different meshes or plain local shards. Here every rank sums
# |g|^p over its local gradients, each divided by the number of ranks holding an identical
# copy, and one all-reduce over the world gives the one-process norm.
def _grads(model_or_params) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """``(local grad to scale, local grad to measure, copies)`` for every parameter with a
    gradient; ``copies`` is how many ranks hold the same elements."""
    world = comm.world_size()
    if isinstance(model_or_params, nn.Module):
        state = get_shard_state(model_or_params)
        named = list(model_or_params.named_parameters())
    else:
        state = None
        if isinstance(model_or_params, torch.Tensor):
            model_or_params = [model_or_params]
        named = [("", p) for p in model_or_params]
    out = []
    for name, p in named:
        g = p.grad
        if g is None:
            continue
        spec = state.specs.get(name) if state is not None else None
        # a tp shard the mesh does not show: a plain local shard, or FSDP over "local" holding
        hidden_tp = 1
        if (state is not None and spec is not None and not spec.replicated
                and state.holding.plain_shards):
            hidden_tp = state.coords(spec)[0]
        if is_dtensor(g):
            dg = g
            mesh = dg.device_mesh
            if {"tp", "ep"} & set(mesh.mesh_dim_names or ()):
                hidden_tp = 1
            if any(pl.is_partial() for pl in dg.placements):
                from torch.distributed.tensor import Replicate

                with comm.guarded("redistribute", group=mesh, purpose=f"the gradient of {name!r}"):
                    dg = dg.redistribute(placements=[Replicate() if pl.is_partial() else pl
                                                     for pl in dg.placements])
            shards = math.prod(mesh.size(i) for i, pl in enumerate(dg.placements) if not pl.is_replicate())
            out.append((cast("DTensor", p.grad).to_local(), dg.to_local(), world // (shards * hidden_tp)))
        else:
            out.append((g, g, world // hidden_tp))
    return out


def clip_grad_norm_(model_or_params: nn.Module | Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, *, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients in place so that their global ``norm_type`` norm is at most
    ``max_norm``; return that norm (before clipping), the same on every rank. Pass the model
    (``"local"`` holding needs it) or its parameters (plain tensors are taken as replicated).
    Every rank calls it: one all-reduce over the world.

    >>> total = sw.clip_grad_norm_(model, 1.0)   # doctest: +SKIP
    """
    norm_type = float(norm_type)
    backend = world_backend()  # the API boundary: the backend of the all-reduce below
    grads = _grads(model_or_params)
    device = grads[0][1].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    if norm_type == math.inf:
        for _, local, _ in grads:
            if local.numel():
                total = torch.maximum(total, local.detach().abs().max().double())
        comm.all_reduce(total, "max", backend=backend, purpose="clip_grad_norm_")
    else:
        for _, local, copies in grads:
            norm = torch.linalg.vector_norm(local.detach(), norm_type, dtype=torch.float64)
            total += norm ** norm_type / copies
        comm.all_reduce(total, backend=backend, purpose="clip_grad_norm_")
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise NonFiniteError(f"the total norm of order {norm_type} of the gradients is {total.item()}; "
                           "pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for target, _, _ in grads:
        target.mul_(coef.to(target.dtype))
    return total.to(torch.float32)


