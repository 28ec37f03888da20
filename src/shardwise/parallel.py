"""Put local shards into a model and make its forward correct under tensor parallelism.

Three holdings (:class:`shardwise.holding.Holding`) come from the same ``ShardSpec``s:

- ``"dtensor"`` (gloo, nccl): parameters become DTensors on the tp axis of the mesh
  and torch's ``ColwiseParallel`` / ``RowwiseParallel`` convert activations. A packed
  shard is a DTensor with ``Shard(dim)`` whose local tensor holds this rank's part of
  every block; its canonical layout is known from the spec, never from the placement.
- ``"local"`` (xla, neuron): parameters are plain local tensors and the forward of each
  planned module is replaced by one that does its collectives itself (autograd-aware).
- ``"spmd"`` (xla_spmd): one process drives every device; a parameter stays one global
  tensor placed over the tp axis of an ``SpmdMesh`` (``backends/xla_spmd.py``) and the
  forward is the model's own: the XLA partitioner inserts the collectives.

``install`` is the one place that writes shards into a model: ``parallelize`` feeds it
slices of the model's own tensors, the loaders feed it slices read from disk.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, TypeGuard, cast

import torch
from torch import nn

from shardwise.core.plan import ResolvedPlan, Style, resolve_plan, without_tp
from shardwise.core.spec import ShardSpec, split
from shardwise.errors import PlanError
from shardwise.holding import Holding, is_dtensor, local_of  # noqa: F401 - local_of: re-exported
from shardwise.local_tp import run_on_local_params, wire_embedding_subclass, wire_forward, wire_local
from shardwise.mesh import MeshDims, decode_mesh
from shardwise.plan_checks import check_installed, check_plan
from shardwise.quant_tp import guard_cut_experts, local_part, quantized_module, scale_is_local, wire_quantized

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from shardwise.backends.xla_spmd import SpmdMesh

_STATE_ATTR = "_shardwise_state"


@dataclass(frozen=True, kw_only=True)
class ShardState(MeshDims):
    """What shardwise knows about a parallelised model (kept on the model): the decoded mesh
    it was installed on (:class:`~shardwise.mesh.MeshDims`) and the resolved plan. Built
    whole by :func:`install`, never changed afterwards."""

    specs: ResolvedPlan

    @classmethod
    def of(cls, dims: MeshDims, specs: ResolvedPlan) -> ShardState:
        return cls(specs=specs, **{f.name: getattr(dims, f.name) for f in fields(MeshDims)})

    __repr__ = MeshDims.__repr__  # the dataclass's own repr would print the whole plan


def get_shard_state(model: nn.Module) -> ShardState | None:
    """The ``ShardState`` that ``parallelize`` / ``load`` recorded on ``model``, or None."""
    return model.__dict__.get(_STATE_ATTR)


def resolve_for_mesh(model: nn.Module, plan, dims: MeshDims, ep_plan=None) -> ResolvedPlan:
    """``resolve_plan`` for the tp and ep axes of ``dims``; unused keys warned about once.
    On a mesh without a tp axis the plan is checked as at degree 1, then its tp part dropped."""
    specs = resolve_plan(model, plan, dims.degree, ep_plan=ep_plan, ep_degree=dims.ep_degree)
    check_plan(model, specs)  # a forward shaping split heads by the global count
    warn_unused_keys(specs)
    return without_tp(specs) if dims.tp_mesh is None else specs


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    prefix, _, leaf = name.rpartition(".")
    module = model.get_submodule(prefix)
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
            dtype: torch.dtype | None = None, holding: str | Holding | None = None) -> ShardState:
    """Replace every tensor of ``model`` by ``local_tensor(name, spec)`` and wire the forward.

    Called on every rank of the mesh, with the same ``specs`` and ``dims`` (the mesh decoded
    by :func:`shardwise.mesh.decode_mesh`; a raw mesh is decoded here with ``holding``, for
    callers below the API such as tests). ``local_tensor`` returns this rank's local shard
    (already on the right device and dtype). No collective runs here: DTensors are built
    from local shards. Afterwards every tensor is checked against what the model declared
    (:func:`shardwise.plan_checks.check_installed`): ``dtype`` is the dtype every
    floating-point tensor must have (``None``: any floating dtype).
    """
    if not isinstance(dims, MeshDims):
        dims = decode_mesh(dims, holding)
        check_wiring(model, specs, dims.holding)
    for axis, degree in (("tp", dims.degree), ("ep", dims.ep_degree)):
        if specs.degrees[axis] != degree:
            raise PlanError(f"plan was resolved for {axis} degree {specs.degrees[axis]} but the mesh "
                            f"{axis} axis has {degree}")
    declared = {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict(keep_vars=True).items()}
    for name, spec in specs.items():
        _set_tensor(model, name, local_tensor(name, spec))
    for alias, kept in specs.aliases.items():  # re-tie shared weights to the one new tensor
        prefix, _, leaf = alias.rpartition(".")
        kept_prefix, _, kept_leaf = kept.rpartition(".")
        setattr(model.get_submodule(prefix), leaf, getattr(model.get_submodule(kept_prefix), kept_leaf))
    state = ShardState.of(dims, specs)
    if dims.holding.wires_forward:  # spmd: the model's own forward is correct, the partitioner
        _wire(model, specs, state)   # adds the collectives
    check_installed(model, specs, declared, holding=dims.holding, dtype=dtype, coords=dims.axis_coords)
    model.__dict__[_STATE_ATTR] = state
    return state


def check_wiring(model: nn.Module, specs: ResolvedPlan, holding: Holding) -> None:
    """Raise ``PlanError`` for a sharded nn.Linear subclass with a forward of its own under
    ``"local"`` holding: its forward is replaced by the local-shard one, which would silently
    skip whatever the subclass adds. (An nn.Embedding subclass keeps its forward in both
    holdings: ``wire_embedding_subclass``.)"""
    if holding is not Holding.LOCAL:
        return
    for path, style in specs.styles.items():
        module = model.get_submodule(path)
        if (style.forward == "linear" and not isinstance(module, nn.Embedding)
                and type(module).forward is not nn.Linear.forward and quantized_module(specs, path) is None):
            raise PlanError(
                f"plan key {specs.keys[path]!r}: {path!r} is a {type(module).__name__}, an nn.Linear "
                f"with a forward of its own, which local holding cannot shard without skipping it; use "
                "holding='dtensor', or plan its submodules instead")


def _own_embedding_forward(module: nn.Module) -> TypeGuard[nn.Embedding]:
    return isinstance(module, nn.Embedding) and type(module).forward is not nn.Embedding.forward


def _wire(model: nn.Module, specs: ResolvedPlan, state: ShardState) -> None:
    # DTensor holding: {id(local Parameter): (that Parameter, its DTensor Parameter)} while
    # wiring, so a tied weight seen from a second module becomes the same DTensor Parameter.
    converted: dict = {}
    dtensor = state.holding is Holding.DTENSOR
    # Owners of parameters sharded by a parameter key first: their local-shard wrapper is
    # innermost, below any style wrapper (moe_experts) of the same module.
    for path in specs.local_owners:
        module = model.get_submodule(path)
        if dtensor:
            _dtensor_params(module, path, state, converted, sharded_only=True)
            run_on_local_params(module)
    for path, style in specs.styles.items():
        module = model.get_submodule(path)
        if style.forward == "linear" and quantized_module(specs, path) is not None:
            if dtensor:
                _dtensor_params(module, path, state, converted)
            wire_quantized(module, path, style, state)  # its own FP8 kernel, on local shards
        elif style.forward != "linear":
            wire_forward(module, style, state)
        elif dtensor:
            _wire_dtensor(module, path, style, state, converted)
        elif _own_embedding_forward(module):
            wire_embedding_subclass(module, style, state)
        else:
            wire_local(module, style, state)
    guard_cut_experts(model, specs)  # FP8 experts whose shards cut blocks: their kernels would be wrong


def parallelize(model: nn.Module, plan, mesh, *, holding: str | None = None, ep_plan=None) -> nn.Module:
    """Shard a materialised ``model`` in place so its forward equals the one-device forward.

    ``plan`` is a dict of module or parameter paths to styles, or ``"auto"`` (the plan the
    model ships). On a mesh with an ``ep`` axis, ``ep_plan`` (default: the model's own)
    shards the experts over it. Every rank must call it with the same weights (same seed, or loaded from
    the same file). ``holding`` defaults to the active backend's mode (``"dtensor"`` on gloo and
    nccl, ``"local"`` on xla and neuron).

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
    if dims.holding.one_process:
        spmd_mesh = cast("SpmdMesh", dims.tp_mesh)  # a one-process holding's mesh
        install(model, specs, dims,
                local_tensor=lambda name, spec: spmd_mesh.distribute(full[name], spec.dim))
        return model
    coords = dims.axis_coords
    # the mesh's device type, not dims.device: a model parallelised over a CPU (gloo) mesh
    # keeps its tensors where they are
    device = torch.device(mesh.device_type) if mesh.device_type != "cpu" else None

    def local_tensor(name: str, spec: ShardSpec) -> torch.Tensor:
        t = full[name].detach()
        local = t if spec.replicated else local_part(t, name, spec, specs, coords[spec.axis])
        return local.to(device) if device is not None and local.device != device else local

    install(model, specs, dims, local_tensor=local_tensor)
    return model


def warn_unused_keys(specs: ResolvedPlan) -> None:
    """One warning, on rank 0 only, listing the plan keys that matched nothing."""
    import torch.distributed as dist

    if specs.unused_keys and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn(f"plan keys that match nothing in this model were skipped: "
                      f"{', '.join(map(repr, specs.unused_keys))}", stacklevel=3)


# -- DTensor holding: torch's styles, with our shards as their parameters ---------------
def _dtensor_params(module: nn.Module, prefix: str, state: ShardState, converted: dict, *,
                    sharded_only: bool = False) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    for pname, p in list(module.named_parameters(recurse=False)):
        done = converted.get(id(p))
        spec = state.specs.spec_of(f"{prefix}.{pname}" if prefix else pname)
        if (sharded_only and spec.replicated) or scale_is_local(state.specs, f"{prefix}.{pname}"):
            continue  # a scale whose blocks shard boundaries cut: held local (shardwise.quant_tp)
        if done is None:  # the first module of a tied weight converts it; the others reuse it
            placement = Replicate() if spec.dim is None else Shard(spec.dim)  # None: replicated
            mesh = cast("DeviceMesh", state.axis_mesh(spec))  # a DTensor holding's meshes are torch's
            d = DTensor.from_local(p.data, mesh, [placement], run_check=False)
            done = (p, _as_parameter(d, p.requires_grad))
            converted[id(p)] = done
        module.register_parameter(pname, done[1])


def _as_parameter(d: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """``d`` (a fresh DTensor leaf) marked as a Parameter: what ``nn.Parameter(d)`` returns for
    a tensor subclass, without its ``d.detach()``, which runs DTensor's sharding propagation
    (milliseconds for each new shape in a fresh process: a load's install paid ~15 ms)."""
    if d.grad_fn is not None:  # not a leaf: let torch make the Parameter its own way
        return nn.Parameter(d, requires_grad=requires_grad)
    d.requires_grad_(requires_grad)
    d._is_param = True  # how torch/nn/parameter.py marks a tensor subclass as a Parameter
    return d if isinstance(d, nn.Parameter) else nn.Parameter(d, requires_grad=requires_grad)


def _wire_dtensor(module: nn.Module, path: str, style: Style, state: ShardState, converted: dict) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if type(module).forward in (nn.Linear.forward, nn.Embedding.forward):
        # DTensor parameters, forward on their local shards with explicit (autograd-aware)
        # collectives, as local holding computes: the same outputs and gradients, without
        # DTensor dispatch, whose first call per op and shape costs milliseconds of Python
        # (a model's first forward paid ~0.15 s of it). Subclasses keep torch's styles below.
        _dtensor_params(module, path, state, converted)
        wire_local(module, style, state)
        run_on_local_params(module)
        return
    if _own_embedding_forward(module):  # a norm or a scale after the lookup: see its docstring
        _dtensor_params(module, path, state, converted)
        wire_embedding_subclass(module, style, state)
        run_on_local_params(module)
        return
    is_embedding = isinstance(module, nn.Embedding)
    base: type[ColwiseParallel | RowwiseParallel]
    if style.kind == "colwise":
        base = ColwiseParallel
        kwargs = {"output_layouts": Replicate()} if (style.gather_output or is_embedding) else {}
    else:
        base = RowwiseParallel
        kwargs = {"input_layouts": Replicate()} if is_embedding else {}

    class _FromShards(base):  # type: ignore[valid-type,misc]  # a base class chosen at run time
        # torch's styles distribute a full tensor; ours already hold their shard.
        def _partition_linear_fn(self, name, mod, device_mesh):
            # torch calls this for every submodule (name relative to `module`): a child's
            # parameters (a norm inside an embedding) are looked up under their own names.
            if mod is module:
                _dtensor_params(mod, path, state, converted)

        _partition_embedding_fn = _partition_linear_fn

    parallelize_module(module, cast("DeviceMesh", state.tp_mesh), _FromShards(**kwargs))
    if style.split_input:
        module.register_forward_pre_hook(_split_input_hook(style, state))


def _split_input_hook(style: Style, state: ShardState):
    def hook(mod, args):
        x = args[0]
        spec = ShardSpec(dim=x.ndim - 1, blocks=style.blocks or (1,))
        return (split(x, spec, state.degree, state.tp_rank),) + tuple(args[1:])

    return hook
