"""Plans: ``{module or parameter path: style}`` to one ``ShardSpec`` per tensor (pure).
:func:`resolve_plan` is the one place a plan is validated (``core.styles`` decodes it,
``core.plan_rules`` holds it to its rules), on a meta model, before any process group."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from torch import nn

from shardwise.core.adapter import adapter_for
from shardwise.core.plan_rules import check_degrees, check_pairs, head_counts
from shardwise.core.quant_layout import QuantTie, is_tied_scale, tie_scales
from shardwise.core.spec import ShardSpec, check_degree
from shardwise.core.styles import (
    DEFAULT_PACKED,
    SUPPORTED_STYLES,
    PackedColwise,
    PackedRowwise,
    Style,
    check_blocks,
    match_plan,
    normalize_style,
)
from shardwise.core.walk import module_table, named_parameters, state_tensors
from shardwise.errors import PlanError

# ``check(model, owned, degrees)``, run by resolve_plan at every degree it tries, raises
# ``PlanError``; ``owned``: {id(parameter): (ShardSpec, name, plan key)}, ``degrees``: {"tp", "ep"}.
ModelCheck = Callable[[nn.Module, Mapping[int, tuple[ShardSpec, str, str]], Mapping[str, int]], None]
_MODEL_CHECKS: list[ModelCheck] = []


def register_model_check(check: ModelCheck) -> ModelCheck:
    """Have :func:`resolve_plan` run ``check`` on every plan, after its own checks (once)."""
    if check not in _MODEL_CHECKS:
        _MODEL_CHECKS.append(check)
    return check


class ResolvedPlan(dict):
    """``{tensor name: ShardSpec}`` for every parameter and persistent buffer of a model, with
    ``styles`` ({module path: Style}, blocks filled in), ``keys`` ({module path or tensor: the
    plan key that claimed it}), ``aliases`` (tied name -> name kept), ``local_owners`` (modules
    whose forward sees the local shards of parameter-key tensors), ``unused_keys``, ``degree``
    (tp) and ``degrees`` ({"tp", "ep"}), ``ties`` ({scale tensor: QuantTie}: a scale follows its
    weight's spec) and ``quantized`` (those weights and scales: they keep their dtypes)."""

    def __init__(self, specs, *, styles, keys, aliases, degree, local_owners=(), unused_keys=(),
                 ep_degree: int = 1, ties: dict[str, QuantTie] | None = None):
        super().__init__(specs)
        self.degrees: dict[str, int] = {"tp": degree, "ep": ep_degree}
        self.styles: dict[str, Style] = styles
        # a public attribute that shadows dict.keys (callers read plan.keys[name])
        self.keys: dict[str, str] = keys  # type: ignore[assignment]
        self.aliases: dict[str, str] = aliases
        self.degree: int = degree
        self.local_owners: tuple[str, ...] = tuple(local_owners)
        self.unused_keys: tuple[str, ...] = tuple(unused_keys)
        self.ties: dict[str, QuantTie] = dict(ties or {})
        self.quantized: frozenset[str] = frozenset(self.ties) | {t.weight for t in self.ties.values()}

    def spec_of(self, name: str) -> ShardSpec:
        """The spec of ``name`` or of the tensor it is tied to (replicated if unknown)."""
        return self.get(self.aliases.get(name, name), ShardSpec())


def _with_blocks(module: nn.Module, style: Style, path: str, key: str) -> Style:
    """``style`` with its packed blocks filled in (the module's ``_tp_packed_*_blocks``)."""
    if not style.sharded or style.blocks is not None:
        return style
    attr = "_tp_packed_col_blocks" if style.kind == "colwise" else "_tp_packed_row_blocks"
    blocks = getattr(module, attr, None)
    if blocks is None and not style.source.startswith("packed_"):
        raise PlanError(
            f"plan key {key!r} ({style.source}) gives no blocks and module {path!r} has no "
            f"{attr}; pass the blocks, e.g. PackedColwise([1, 1])"
        )
    return replace(style, blocks=DEFAULT_PACKED if blocks is None else check_blocks(blocks, f"{path}.{attr}"))


def _module_specs(module: nn.Module, style: Style, path: str, key: str) -> dict[str, ShardSpec]:
    """Specs of the module's own tensors under a module key's ``style``: those parameter keys
    would give its weight and bias (an embedding's by ``kind`` alone; always on the tp axis)."""
    if not style.sharded:
        return {}
    is_embedding = isinstance(module, nn.Embedding)
    if not (isinstance(module, nn.Linear) or is_embedding):
        raise PlanError(
            f"plan key {key!r} applies {style.source!r} to {path!r}, a {type(module).__name__}; "
            "sharded module styles apply to nn.Linear and nn.Embedding modules only (name a "
            "parameter in the key to shard it alone)"
        )
    if is_embedding and (len(style.blocks or ()) > 1 or style.split_input):
        raise PlanError(f"plan key {key!r}: style {style.source!r} does not apply to the embedding {path!r}")
    style = _on_tp(style, is_embedding)
    params = module._parameters  # a property (a parametrization) is read as an attribute
    return {leaf: _param_spec(len(t.shape), leaf == "bias", style) for leaf in ("weight", "bias")
            if (t := params[leaf] if leaf in params else getattr(module, leaf, None)) is not None}


@functools.lru_cache(maxsize=256)  # one per style of a plan: not a dataclasses.replace per module
def _on_tp(style: Style, embedding: bool) -> Style:
    return replace(style, embedding=embedding, axis="tp")


@functools.lru_cache(maxsize=1024)  # specs are frozen: one per (ndim, style), not one per tensor
def _param_spec(ndim: int, bias: bool, style: Style) -> ShardSpec:
    """A parameter key's spec, as transformers: colwise splits dim ``ndim - 2``, rowwise the
    last dim; a rowwise ``bias`` stays whole; an embedding's: dim 0 (rowwise) or 1."""
    if style.axis == "ep" and style.sharded and ndim:  # grouped_gemm: whole experts per rank
        return ShardSpec(dim=0, axis="ep")
    if not style.sharded or ndim == 0 or (style.kind == "rowwise" and bias):
        return ShardSpec()
    if style.embedding:
        return ShardSpec(dim=0 if style.kind == "rowwise" else min(1, ndim - 1))
    dim = max(ndim - 2, 0) if style.kind == "colwise" else ndim - 1
    assert style.blocks is not None  # a sharded style's blocks are filled in (_with_blocks)
    return ShardSpec(dim=dim, blocks=style.blocks)


def _rope_dim(model: nn.Module, path: str, key: str) -> int:
    # The attention module's own width first: some configs hold it per layer.
    value = getattr(model.get_submodule(path.rpartition(".")[0]), "qk_rope_head_dim", None)
    if value is None:
        config: Any = getattr(model, "config", None)  # a transformers config, duck-typed
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        try:
            value = getattr(text, "qk_rope_head_dim", None)
        except Exception:  # noqa: BLE001 - a per-layer attribute refuses a global read
            value = None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:  # 0: no rotary part
        raise PlanError(f"plan key {key!r} uses 'mla_kv_a_proj', which needs the model config's "
                        "qk_rope_head_dim (the rotary part of the projection's output); this model has none")
    return value


def _claim(owned: dict, tensor, name: str, spec: ShardSpec, key: str) -> None:
    if id(tensor) in owned and owned[id(tensor)][1] != name and owned[id(tensor)][0] != spec:
        other = owned[id(tensor)]
        raise PlanError(f"plan key {key!r} shards {name!r} as {spec}, but the same tied tensor "
                        f"is {other[1]!r} sharded as {other[0]}; plan tied modules alike")
    owned[id(tensor)] = (spec, name, key)


def plan_from_model(model: nn.Module) -> dict:
    """The tensor-parallel plan ``model`` ships (its adapter reads it); ``PlanError`` if none."""
    plan = adapter_for(model).shipped_plan(model, "tp")
    if not plan:
        raise PlanError(f"plan='auto', but {type(model).__name__} ships no tensor-parallel plan (no tp_plan, "
                        "_tp_plan or config.base_model_tp_plan); pass plan={module path: style}")
    return plan


def resolve_plan(model: nn.Module, plan, degree: int, *, strict: bool = False, ep_plan=None,
                 ep_degree: int = 1) -> ResolvedPlan:
    """The :class:`ResolvedPlan` of ``plan`` ({module or parameter path: style}, or ``"auto"``:
    the model's own) on ``model`` (a meta model will do) at tp ``degree``. Raises ``PlanError``
    for a bad style, a module claimed twice, an unpaired projection (:func:`check_pairs`), and
    ``ShardingError`` where a degree does not split a tensor, a packed block or a head count.
    Tensors outside the plan are replicated; keys matching nothing go to ``unused_keys``
    (``strict=True``: ``PlanError``). With ``ep_degree > 1``, ``ep_plan`` (or ``"auto"``) shards
    the experts over ep and wins over ``plan`` on those modules and below, as in transformers.

    >>> specs = resolve_plan(model, {"layers.*.mlp.up": "colwise"}, degree=2)  # doctest: +SKIP
    >>> specs["layers.0.mlp.up.weight"]                                         # doctest: +SKIP
    ShardSpec(dim=0, blocks=(1,))
    """
    check_degree(degree)
    if isinstance(plan, str) and plan == "auto":
        plan = plan_from_model(model)
    module_claims, param_claims, unused = match_plan(model, plan, strict=strict)
    check_degree(ep_degree, names=("ep_degree", "rank"))
    if ep_degree > 1:
        module_claims, param_claims, ep_unused = _with_ep_plan(model, ep_plan, module_claims,
                                                               param_claims, strict)
        unused = unused + ep_unused
    # a key naming a quantized weight's scales (transformers adds them): scales follow their weight
    param_claims = {n: c for n, c in param_claims.items() if not is_tied_scale(model, n)}
    modules = module_table(model)
    styles: dict[str, Style] = {}
    keys: dict[str, str] = {}
    owned: dict[int, tuple[ShardSpec, str, str]] = {}
    for path, (key, raw) in module_claims.items():
        module = modules[path]
        style = _with_blocks(module, normalize_style(raw, key=key), path, key)
        if style.gather_output and len(style.blocks or ()) > 1:
            raise PlanError(f"plan key {key!r}: gathering the output of a packed projection "
                            "is not supported")
        if style.forward == "mla_kv_a":
            style = replace(style, rope_dim=_rope_dim(model, path, key))
        styles[path], keys[path] = style, key
        for pname, spec in _module_specs(module, style, path, key).items():
            _claim(owned, getattr(module, pname), f"{path}.{pname}", spec, key)
    local_owners: list[str] = []
    sharded = [p for p, s in styles.items() if s.sharded]
    for name, (key, raw) in param_claims.items():
        path, _, leaf = name.rpartition(".")
        module = modules[path]
        tensor = getattr(module, leaf)
        style = _with_blocks(module, normalize_style(raw, key=key), path, key)
        spec = _param_spec(len(tensor.shape), leaf == "bias", style)
        keys[name] = key
        _claim(owned, tensor, name, spec, key)  # a parameter key overrides its module's key
        if not spec.replicated:
            sharded.append(name)
            if path not in local_owners:
                local_owners.append(path)
    tensors = named_parameters(model)
    check_pairs({n: owned[id(t)][0] if id(t) in owned else ShardSpec() for n, t in tensors.items()},
                {n: tuple(t.shape) for n, t in tensors.items()}, styles, keys, degree)

    def others(degrees: dict[str, int]) -> None:  # the checks whose outcome depends on the degrees
        for check in _MODEL_CHECKS:
            check(model, owned, degrees)

    check_degrees([(tuple(tensors[n].shape), spec, n, key) for spec, n, key in owned.values()],
                  head_counts(model, sharded), keys, {"tp": degree, "ep": ep_degree}, others)
    _count_experts(model, styles, owned)
    others({"tp": degree, "ep": ep_degree})

    specs: dict[str, ShardSpec] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, tensor in state_tensors(model).items():
        if id(tensor) in first_name:  # a tied weight: one tensor, several names
            kept = first_name[id(tensor)]
            aliases[name] = kept
            _check_tied(name, kept, owned.get(id(tensor)), module_claims, param_claims)
            continue
        first_name[id(tensor)] = name
        specs[name] = owned[id(tensor)][0] if id(tensor) in owned else ShardSpec()
    ties = tie_scales(model, specs, styles, keys, {"tp": degree, "ep": ep_degree})
    local_owners = [p for p in local_owners if f"{p}.weight" not in {t.weight for t in ties.values()}]
    return ResolvedPlan(specs, styles=styles, keys=keys, aliases=aliases, degree=degree,
                        local_owners=local_owners, unused_keys=unused, ep_degree=ep_degree, ties=ties)


def _with_ep_plan(model: nn.Module, ep_plan, module_claims: dict, param_claims: dict, strict: bool):
    """The claims of the tp plan without the expert modules, plus those of the ep plan."""
    if ep_plan is None or (isinstance(ep_plan, str) and ep_plan == "auto"):
        ep_plan = adapter_for(model).shipped_plan(model, "ep")
    ep_modules, ep_params, unused = match_plan(model, ep_plan, strict=strict, what="ep_plan")
    for key, raw in ep_plan.items():
        if normalize_style(raw, key=key).axis != "ep":
            raise PlanError(f"ep_plan key {key!r} has style {raw!r}; an ep plan holds 'grouped_gemm' "
                            "(expert parameters) and 'ep_dispatch_experts' (the experts module)")
    roots = tuple(set(ep_modules) | set(ep_params))

    def tp_kept(name: str) -> bool:  # ep rules win over tp rules on the same modules and below
        return not any(name == r or name.startswith(r + ".") for r in roots)

    modules = {p: c for p, c in module_claims.items() if tp_kept(p)} | ep_modules
    params = {n: c for n, c in param_claims.items() if tp_kept(n)} | ep_params
    return modules, params, unused


def _count_experts(model: nn.Module, styles: dict[str, Style], owned: dict) -> None:
    """Give each ``ep_dispatch_experts`` style the global expert count of its module."""
    for path, style in list(styles.items()):
        if style.forward != "ep_experts":
            continue
        module = model.get_submodule(path)
        counts = {p.shape[0] for p in module.parameters(recurse=False)
                  if id(p) in owned and owned[id(p)][0].axis == "ep"}
        if len(counts) != 1:
            raise PlanError(f"ep_dispatch_experts on {path!r} needs its expert parameters sharded by "
                            f"'grouped_gemm' (one expert count), found counts {sorted(counts)}")
        styles[path] = replace(style, num_experts=counts.pop())


def _check_tied(name: str, kept: str, owner, module_claims, param_claims) -> None:
    """A sharded tied tensor needs every module using it planned, or one forward is wrong."""
    if owner is None or owner[0].replicated:
        return
    for n in (name, kept):
        if n.rpartition(".")[0] not in module_claims and n not in param_claims:
            raise PlanError(
                f"{n!r} is tied to {owner[1]!r}, which the plan shards as {owner[0]}, but module "
                f"{n.rpartition('.')[0]!r} has no plan entry; plan both tied modules alike"
            )


def plan_summary(resolved: ResolvedPlan) -> dict[str, str]:
    """``{module path: style source}``, for logs and a checkpoint's informational JSON."""
    return {p: s.source or s.kind for p, s in resolved.styles.items()}


def without_tp(specs: ResolvedPlan) -> ResolvedPlan:
    """``specs`` with every tp-sharded tensor replicated and no tp style (ep ones stay): a
    degree-1 tp style would still make DTensors, which ``fully_shard`` refuses to combine."""
    kept = {n: s if s.axis == "ep" else ShardSpec() for n, s in specs.items()}
    styles = {p: s for p, s in specs.styles.items() if s.axis == "ep"}
    owners = [p for p in specs.local_owners
              if any(n.rpartition(".")[0] == p and not s.replicated for n, s in kept.items())]
    keys = {k: v for k, v in specs.keys.items() if k in styles or not kept.get(k, ShardSpec()).replicated}
    return ResolvedPlan(kept, styles=styles, keys=keys, aliases=specs.aliases, degree=1,
                        local_owners=owners, unused_keys=specs.unused_keys,
                        ep_degree=specs.degrees["ep"], ties=specs.ties)


__all__ = [
    "PackedColwise", "PackedRowwise", "ResolvedPlan", "SUPPORTED_STYLES", "Style",
    "match_plan", "normalize_style", "plan_from_model", "plan_summary",
    "register_model_check", "resolve_plan", "without_tp",
]
