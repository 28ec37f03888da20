"""Put local shards into a model and make its forward correct under tensor parallelism.

Two holding modes come from the same ``ShardSpec``s:

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
from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.backends import current_backend
from shardwise.core.plan import ResolvedPlan, Style, resolve_plan, without_tp
from shardwise.core.spec import ShardSpec, split
from shardwise.errors import PlanError, UsageError
from shardwise.installed import check_installed, local_of  # noqa: F401 - local_of: re-exported
from shardwise.local_tp import run_on_local_params, wire_embedding_subclass, wire_forward, wire_local
from shardwise.plan_checks import check_plan
from shardwise.quant_tp import local_part, quantized_module, scale_is_local, wire_quantized

HOLDINGS = ("dtensor", "local", "spmd")
_STATE_ATTR = "_shardwise_state"


@dataclass
class ShardState:
    """What shardwise knows about a parallelised model (kept on the model)."""

    mesh: object                       # the DeviceMesh passed in (may be 2-D)
    tp_mesh: object                    # its tp axis (None: the mesh has none, degree 1)
    degree: int
    tp_rank: int                       # 0 under "spmd": one process holds every position
    holding: str
    specs: ResolvedPlan
    group: object = field(repr=False, default=None)  # process group of the tp axis
    ep_mesh: object = field(repr=False, default=None)  # the ep axis (expert parallel), if any
    ep_degree: int = 1
    ep_rank: int = 0
    ep_group: object = field(repr=False, default=None)
    # DTensor holding: {id(local Parameter): (that Parameter, its DTensor Parameter)} while
    # wiring, so a tied weight seen from a second module becomes the same DTensor Parameter.
    converted: dict = field(repr=False, default_factory=dict)


    def coords(self, spec: ShardSpec) -> tuple[int, int]:
        """``(degree, rank)`` of this rank on the mesh axis ``spec`` shards over."""
        return (self.ep_degree, self.ep_rank) if spec.axis == "ep" else (self.degree, self.tp_rank)

    def axis_mesh(self, spec: ShardSpec):
        return self.ep_mesh if spec.axis == "ep" else self.tp_mesh


def get_shard_state(model: nn.Module) -> ShardState | None:
    """The ``ShardState`` that ``parallelize`` / ``load`` recorded on ``model``, or None."""
    return model.__dict__.get(_STATE_ATTR)


def tp_axis(mesh):
    """The tp axis of ``mesh``: ``mesh["tp"]`` when named, an unnamed 1-D mesh itself, and
    ``None`` when the mesh names its axes and none is "tp" (``backend.mesh(dp_shard=4)``,
    ``backend.mesh(ep=2)``): nothing is tensor parallel there, so the model is held whole
    (ready for ``fully_shard``) instead of the TP plan splitting it over a data axis."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "tp" in names:
        return mesh["tp"] if len(names) > 1 else mesh
    if not names and mesh.ndim == 1:
        return mesh
    if not names:
        raise PlanError(f"a {mesh.ndim}-D mesh without axis names has no 'tp' axis; build it with "
                        "backend.mesh(tp=...)")
    if getattr(mesh, "spmd", False):  # one global tensor per parameter needs an axis to place it on
        raise PlanError(f"the xla_spmd mesh with axes {names} has no 'tp' axis; add tp=1 to hold the "
                        "model whole: backend.mesh(..., tp=1)")
    return None


def ep_axis(mesh):
    """The ep axis of ``mesh`` (expert parallel), or ``None`` when it has none."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh["ep"] if "ep" in names else None


def mesh_coords(mesh, *, spmd: bool = False) -> dict[str, tuple[int, int]]:
    """``{"tp": (degree, rank), "ep": (degree, rank)}`` of this process on ``mesh``."""
    tp, ep = tp_axis(mesh), ep_axis(mesh)
    return {"tp": (1, 0) if tp is None else (tp.size(), 0 if spmd else tp.get_local_rank()),
            "ep": (1, 0) if ep is None else (ep.size(), 0 if spmd else ep.get_local_rank())}


def resolve_for_mesh(model: nn.Module, plan, mesh, ep_plan=None) -> ResolvedPlan:
    """``resolve_plan`` for the tp and ep axes of ``mesh``; unused keys warned about once.
    On a mesh without a tp axis the plan is checked as at degree 1, then its tp part dropped."""
    tp, ep = tp_axis(mesh), ep_axis(mesh)
    specs = resolve_plan(model, plan, 1 if tp is None else tp.size(), ep_plan=ep_plan,
                         ep_degree=1 if ep is None else ep.size())
    check_plan(model, specs)  # a forward shaping split heads by the global count
    warn_unused_keys(specs)
    return without_tp(specs) if tp is None else specs


def default_holding() -> str:
    backend = current_backend()
    return backend.holding if backend is not None else "dtensor"


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    prefix, _, leaf = name.rpartition(".")
    module = model.get_submodule(prefix)
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        raise PlanError(f"{name!r} is neither a parameter nor a buffer of the model")


def install(model: nn.Module, specs: ResolvedPlan, mesh, *, holding: str,
            local_tensor: Callable[[str, ShardSpec], torch.Tensor],
            dtype: torch.dtype | None = None) -> ShardState:
    """Replace every tensor of ``model`` by ``local_tensor(name, spec)`` and wire the forward.

    Called on every rank of the mesh, with the same ``specs``. ``local_tensor`` returns
    this rank's local shard (already on the right device and dtype). No collective runs
    here: DTensors are built from local shards. Afterwards every tensor is checked
    against what the model declared (:func:`shardwise.installed.check_installed`): ``dtype`` is the dtype
    every floating-point tensor must have (``None``: any floating dtype).
    """
    if holding not in HOLDINGS:
        raise UsageError(f"holding must be one of {HOLDINGS}, got {holding!r}")
    tp_mesh = tp_axis(mesh)  # None: no tp axis, nothing tensor parallel (degree 1)
    check_spmd(mesh if tp_mesh is None else tp_mesh, holding)
    spmd = holding == "spmd"
    degree, tp_rank = mesh_coords(mesh, spmd=spmd)["tp"]
    if specs.degree != degree:
        raise PlanError(f"plan was resolved for degree {specs.degree} but the mesh tp axis has {degree}")
    check_wiring(model, specs, holding)
    declared = {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict(keep_vars=True).items()}
    for name, spec in specs.items():
        _set_tensor(model, name, local_tensor(name, spec))
    for alias, kept in specs.aliases.items():  # re-tie shared weights to the one new tensor
        prefix, _, leaf = alias.rpartition(".")
        kept_prefix, _, kept_leaf = kept.rpartition(".")
        setattr(model.get_submodule(prefix), leaf, getattr(model.get_submodule(kept_prefix), kept_leaf))
    ep_mesh = ep_axis(mesh)
    state = ShardState(mesh=mesh, tp_mesh=tp_mesh, degree=degree, tp_rank=tp_rank, holding=holding,
                       specs=specs, group=None if tp_mesh is None else tp_mesh.get_group(),
                       ep_mesh=ep_mesh)
    if ep_mesh is not None:
        state.ep_degree, state.ep_rank = ep_mesh.size(), 0 if spmd else ep_mesh.get_local_rank()
        state.ep_group = ep_mesh.get_group()
    if specs.degrees["ep"] != state.ep_degree:
        raise PlanError(f"plan was resolved for ep degree {specs.degrees['ep']} but the mesh ep axis "
                        f"has {state.ep_degree}")
    if not spmd:  # spmd: the model's own forward is correct, the partitioner adds collectives
        _wire(model, specs, state)
    state.converted.clear()
    check_installed(model, specs, declared, holding=holding, dtype=dtype,
                    coords=mesh_coords(mesh, spmd=spmd))
    model.__dict__[_STATE_ATTR] = state
    return state


def check_wiring(model: nn.Module, specs: ResolvedPlan, holding: str) -> None:
    """Raise ``PlanError`` for a sharded nn.Linear subclass with a forward of its own under
    ``"local"`` holding: its forward is replaced by the local-shard one, which would silently
    skip whatever the subclass adds. (An nn.Embedding subclass keeps its forward in both
    holdings: ``wire_embedding_subclass``.)"""
    if holding != "local":
        return
    for path, style in specs.styles.items():
        module = model.get_submodule(path)
        if (style.forward == "linear" and not isinstance(module, nn.Embedding)
                and type(module).forward is not nn.Linear.forward and quantized_module(specs, path) is None):
            raise PlanError(
                f"plan key {specs.keys[path]!r}: {path!r} is a {type(module).__name__}, an nn.Linear "
                f"with a forward of its own, which local holding cannot shard without skipping it; use "
                "holding='dtensor', or plan its submodules instead")


def _own_embedding_forward(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding) and type(module).forward is not nn.Embedding.forward


def _wire(model: nn.Module, specs: ResolvedPlan, state: ShardState) -> None:
    # Owners of parameters sharded by a parameter key first: their local-shard wrapper is
    # innermost, below any style wrapper (moe_experts) of the same module.
    for path in specs.local_owners:
        module = model.get_submodule(path)
        if state.holding == "dtensor":
            _dtensor_params(module, path, state, sharded_only=True)
            run_on_local_params(module)
    for path, style in specs.styles.items():
        module = model.get_submodule(path)
        if style.forward == "linear" and quantized_module(specs, path) is not None:
            if state.holding == "dtensor":
                _dtensor_params(module, path, state)
            wire_quantized(module, path, style, state)  # its own FP8 kernel, on local shards
        elif style.forward != "linear":
            wire_forward(module, style, state)
        elif state.holding == "dtensor":
            _wire_dtensor(module, path, style, state)
        elif _own_embedding_forward(module):
            wire_embedding_subclass(module, style, state)
        else:
            wire_local(module, style, state)
    if state.holding == "dtensor":
        _replicated_as_dtensor(model, state)


def _replicated_as_dtensor(model: nn.Module, state: ShardState) -> None:
    """DTensor holding: every parameter still plain (replicated: a norm, a router, an unplanned
    layer) becomes a ``Replicate()`` DTensor on the tp axis (else the ep axis), and its module
    runs on the local tensors. torch's foreach optimizers (AdamW's default on CUDA and on
    PrivateUse1 devices) refuse a parameter list that mixes DTensor and plain tensors."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = state.tp_mesh if state.tp_mesh is not None else state.ep_mesh
    if mesh is None:  # nothing tensor or expert parallel: no DTensor at all
        return
    for path, module in model.named_modules():
        plain = [(n, p) for n, p in module._parameters.items()
                 if p is not None and type(p).__name__ != "DTensor"
                 and state.specs.spec_of(f"{path}.{n}" if path else n).replicated]
        for pname, p in plain:
            done = state.converted.get(id(p))
            if done is None:  # the first module of a tied weight converts it; the others reuse it
                d = DTensor.from_local(p.data, mesh, [Replicate()], run_check=False)
                done = (p, _as_parameter(d, p.requires_grad))
                state.converted[id(p)] = done
            module.register_parameter(pname, done[1])
        if plain:
            run_on_local_params(module)


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
    tp_mesh = tp_axis(mesh)
    specs = resolve_for_mesh(model, plan, mesh, ep_plan)
    full = model.state_dict()
    meta = [n for n in specs if full[n].is_meta]
    if meta:
        raise PlanError(f"parallelize needs a materialised model, but {meta[0]!r} is on the meta "
                        "device; use sw.load(model, path, plan=..., mesh=...) to fill a meta model")
    holding = holding or default_holding()
    if holding == "spmd":
        install(model, specs, mesh, holding=holding,
                local_tensor=lambda name, spec: tp_mesh.distribute(full[name], spec.dim))
        return model
    coords = mesh_coords(mesh)
    device = torch.device(mesh.device_type) if mesh.device_type != "cpu" else None

    def local_tensor(name: str, spec: ShardSpec) -> torch.Tensor:
        t = full[name].detach()
        local = t if spec.replicated else local_part(t, name, spec, specs, coords[spec.axis])
        return local.to(device) if device is not None and local.device != device else local

    install(model, specs, mesh, holding=holding, local_tensor=local_tensor)
    return model


def warn_unused_keys(specs: ResolvedPlan) -> None:
    """One warning, on rank 0 only, listing the plan keys that matched nothing."""
    import torch.distributed as dist

    if specs.unused_keys and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn(f"plan keys that match nothing in this model were skipped: "
                      f"{', '.join(map(repr, specs.unused_keys))}", stacklevel=3)


def check_spmd(tp_mesh, holding: str) -> None:
    """Raise ``PlanError`` unless ``holding`` is ``"spmd"`` exactly when the mesh is an SPMD mesh."""
    is_spmd = bool(getattr(tp_mesh, "spmd", False))
    if is_spmd and holding != "spmd":
        raise PlanError(f"holding {holding!r} needs one process per device, but this mesh is an SPMD "
                        "mesh (one process drives every device); use holding='spmd' or leave it unset")
    if holding == "spmd" and not is_spmd:
        raise PlanError("holding 'spmd' needs the mesh of sw.init_backend('xla_spmd') (one process "
                        "driving every device); with one process per device use 'dtensor' or 'local'")


# -- DTensor holding: torch's styles, with our shards as their parameters ---------------
def _dtensor_params(module: nn.Module, prefix: str, state: ShardState, *, sharded_only: bool = False) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    for pname, p in list(module.named_parameters(recurse=False)):
        done = state.converted.get(id(p))
        spec = state.specs.spec_of(f"{prefix}.{pname}" if prefix else pname)
        if (sharded_only and spec.replicated) or scale_is_local(state.specs, f"{prefix}.{pname}"):
            continue  # a scale whose blocks shard boundaries cut: held local (shardwise.quant_tp)
        if done is None:  # the first module of a tied weight converts it; the others reuse it
            placement = Replicate() if spec.replicated else Shard(spec.dim)
            d = DTensor.from_local(p.data, state.axis_mesh(spec), [placement], run_check=False)
            done = (p, _as_parameter(d, p.requires_grad))
            state.converted[id(p)] = done
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


def _wire_dtensor(module: nn.Module, path: str, style: Style, state: ShardState) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if type(module).forward in (nn.Linear.forward, nn.Embedding.forward):
        # DTensor parameters, forward on their local shards with explicit (autograd-aware)
        # collectives, as local holding computes: the same outputs and gradients, without
        # DTensor dispatch, whose first call per op and shape costs milliseconds of Python
        # (a model's first forward paid ~0.15 s of it). Subclasses keep torch's styles below.
        _dtensor_params(module, path, state)
        wire_local(module, style, state)
        run_on_local_params(module)
        return
    if _own_embedding_forward(module):  # a norm or a scale after the lookup: see its docstring
        _dtensor_params(module, path, state)
        wire_embedding_subclass(module, style, state)
        run_on_local_params(module)
        return
    is_embedding = isinstance(module, nn.Embedding)
    if style.kind == "colwise":
        base = ColwiseParallel
        kwargs = {"output_layouts": Replicate()} if (style.gather_output or is_embedding) else {}
    else:
        base = RowwiseParallel
        kwargs = {"input_layouts": Replicate()} if is_embedding else {}

    class _FromShards(base):
        # torch's styles distribute a full tensor; ours already hold their shard.
        def _partition_linear_fn(self, name, mod, device_mesh):
            # torch calls this for every submodule (name relative to `module`): a child's
            # parameters (a norm inside an embedding) are looked up under their own names.
            if mod is module:
                _dtensor_params(mod, path, state)

        _partition_embedding_fn = _partition_linear_fn

    parallelize_module(module, state.tp_mesh, _FromShards(**kwargs))
    if style.split_input:
        module.register_forward_pre_hook(_split_input_hook(style, state))


def _split_input_hook(style: Style, state: ShardState):
    def hook(mod, args):
        x = args[0]
        spec = ShardSpec(dim=x.ndim - 1, blocks=style.blocks or (1,))
        return (split(x, spec, state.degree, state.tp_rank),) + tuple(args[1:])

    return hook
