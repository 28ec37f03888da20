"""Plans: from ``{module or parameter path: style}`` to one ``ShardSpec`` per tensor, and the
rules a plan is held to. :func:`resolve_plan` is the one place a plan is validated, on a meta
model, before any process group is touched. Pure: no torch.distributed, no file I/O."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from typing import Any

from torch import nn

from shardwise.core.adapter import adapter_for
from shardwise.core.quant_layout import MXFP4_SUFFIXES, QuantTie, is_tied_scale, tie_scales
from shardwise.core.spec import ShardSpec, block_sizes, check_degree, check_shardable, dividing_degrees
from shardwise.core.styles import (
    DEFAULT_PACKED,
    SUPPORTED_STYLES,
    PackedColwise,
    PackedRowwise,
    Style,
    check_blocks,
    normalize_style,
)
from shardwise.errors import PlanError, ShardingError

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


def _module_blocks(module: nn.Module, style: Style, path: str, key: str) -> tuple[int, ...]:
    if style.blocks is not None:
        return style.blocks
    attr = "_tp_packed_col_blocks" if style.kind == "colwise" else "_tp_packed_row_blocks"
    blocks = getattr(module, attr, None)
    if blocks is None:
        if style.source.startswith("packed_"):
            return DEFAULT_PACKED
        raise PlanError(
            f"plan key {key!r} ({style.source}) gives no blocks and module {path!r} has no "
            f"{attr}; pass the blocks, e.g. PackedColwise([1, 1])"
        )
    return check_blocks(blocks, f"{path}.{attr}")


def _module_specs(module: nn.Module, style: Style, path: str, key: str) -> dict[str, ShardSpec]:
    """Specs of the module's own tensors under a module key's ``style``."""
    if not style.sharded:
        return {}
    assert style.blocks is not None  # a sharded style's blocks are filled in (_module_blocks)
    is_embedding = isinstance(module, nn.Embedding)
    if not (isinstance(module, nn.Linear) or is_embedding):
        raise PlanError(
            f"plan key {key!r} applies {style.source!r} to {path!r}, a {type(module).__name__}; "
            "sharded module styles apply to nn.Linear and nn.Embedding modules only (name a "
            "parameter in the key to shard it alone)"
        )
    if is_embedding and (len(style.blocks) > 1 or style.split_input):
        raise PlanError(f"plan key {key!r}: style {style.source!r} does not apply to the embedding {path!r}")
    if is_embedding:
        # colwise = split the embedding dim; rowwise = split the vocabulary.
        return {"weight": ShardSpec(dim=1 if style.kind == "colwise" else 0)}
    specs = {"weight": ShardSpec(dim=0 if style.kind == "colwise" else 1, blocks=style.blocks)}
    if getattr(module, "bias", None) is not None:
        specs["bias"] = ShardSpec(dim=0, blocks=style.blocks) if style.kind == "colwise" else ShardSpec()
    return specs


def _param_spec(shape: tuple[int, ...], leaf: str, style: Style) -> ShardSpec:
    """A parameter key's spec, as transformers: colwise splits dim ``ndim - 2``, rowwise the
    last dim; a rowwise ``bias`` stays whole."""
    ndim = len(shape)
    if style.axis == "ep" and style.sharded and ndim:  # grouped_gemm: whole experts per rank
        return ShardSpec(dim=0, axis="ep")
    if not style.sharded or ndim == 0 or (style.kind == "rowwise" and leaf == "bias"):
        return ShardSpec()
    if style.embedding:
        return ShardSpec(dim=0 if style.kind == "rowwise" else min(1, ndim - 1))
    dim = max(ndim - 2, 0) if style.kind == "colwise" else ndim - 1
    assert style.blocks is not None  # a sharded style's blocks are filled in (_module_blocks)
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


def _tensor(model: nn.Module, name: str):
    path, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(path), leaf)


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
    check_some_key_matches(model, plan, unused)
    check_degree(ep_degree, names=("ep_degree", "rank"))
    if ep_degree > 1:
        module_claims, param_claims, ep_unused = _with_ep_plan(model, ep_plan, module_claims,
                                                               param_claims, strict)
        unused = unused + ep_unused
    # a key naming a quantized weight's scales (transformers adds them): scales follow their weight
    param_claims = {n: c for n, c in param_claims.items() if not is_tied_scale(model, n)}
    styles: dict[str, Style] = {}
    keys: dict[str, str] = {}
    owned: dict[int, tuple[ShardSpec, str, str]] = {}
    for path, (key, raw) in module_claims.items():
        style = normalize_style(raw, key=key)
        module = model.get_submodule(path)
        if style.sharded:
            blocks = _module_blocks(module, style, path, key)
            style = replace(style, blocks=blocks)
            if style.gather_output and len(blocks) > 1:
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
        style = normalize_style(raw, key=key)
        path, _, leaf = name.rpartition(".")
        module = model.get_submodule(path)
        if style.sharded:
            style = replace(style, blocks=_module_blocks(module, style, path, key))
        tensor = getattr(module, leaf)
        spec = _param_spec(tuple(tensor.shape), leaf, style)
        keys[name] = key
        _claim(owned, tensor, name, spec, key)  # a parameter key overrides its module's key
        if not spec.replicated:
            sharded.append(name)
            if path not in local_owners:
                local_owners.append(path)
    tensors = dict(model.named_parameters(remove_duplicate=False))
    check_pairs({n: owned[id(t)][0] if id(t) in owned else ShardSpec() for n, t in tensors.items()},
                {n: tuple(t.shape) for n, t in tensors.items()}, styles, keys, degree)

    def others(degrees: dict[str, int]) -> None:  # the checks whose outcome depends on the degrees
        for check in _MODEL_CHECKS:
            check(model, owned, degrees)

    check_degrees([(tuple(_tensor(model, n).shape), spec, n, key) for spec, n, key in owned.values()],
                  head_counts(model, sharded), keys, {"tp": degree, "ep": ep_degree}, others)
    _count_experts(model, styles, owned)
    others({"tp": degree, "ep": ep_degree})

    specs: dict[str, ShardSpec] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
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
    ep_modules, ep_params, unused = match_plan(model, ep_plan, strict=strict)
    check_some_key_matches(model, ep_plan, unused, what="ep_plan")
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


# -- key matching ---------------------------------------------------------------------------

def match_plan(model: nn.Module, plan: Mapping, *, strict: bool = False):
    """``({module path: (key, style)}, {parameter: (key, style)}, unmatched keys)``: each ``*``
    is one numeric path component; a key also matches under the adapter's ``base_prefix``."""
    if not isinstance(plan, Mapping):
        raise PlanError(f"a plan must be a dict of module path -> style, got {type(plan).__name__}")
    module_names = [n for n, _ in model.named_modules()]
    param_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    prefix = adapter_for(model).base_prefix(model)
    modules: dict[str, tuple[str, object]] = {}
    params: dict[str, tuple[str, object]] = {}
    unused: list[str] = []
    for key, style in plan.items():
        if not isinstance(key, str) or not key:
            raise PlanError(f"plan keys must be module or parameter paths (non-empty strings), got {key!r}")
        normalize_style(style, key=key)  # an unknown style is an error even where nothing matches
        hits = _hits_under(key, prefix, module_names, param_names)
        if not any(hits):  # MXFP4 `x` held as `x_blocks` + `x_scales`: the key names `x`, as transformers
            hits = ([], _hits_under(key + MXFP4_SUFFIXES[0], prefix, module_names, param_names)[1])
        if not any(hits):
            if strict:
                near = closest_paths(key, _patterns(model), prefix)
                raise PlanError(f"plan key {key!r} matches no module or parameter; did you mean "
                                f"{', '.join(map(repr, near))}?")
            unused.append(key)
            continue
        for claimed, names in zip((modules, params), hits, strict=True):
            for name in names:
                if name in claimed and claimed[name][1] != style:
                    raise PlanError(f"plan keys {claimed[name][0]!r} and {key!r} both claim {name!r} "
                                    "with different styles; keep one entry per module or parameter")
                claimed[name] = (key, style)
    return modules, params, unused


def _hits_under(key: str, prefix: str, module_names, param_names) -> tuple[list[str], list[str]]:
    """The module and parameter names ``key`` matches, else those it matches under ``prefix``."""
    for full in (key, f"{prefix}.{key}") if prefix else (key,):
        pattern = re.compile(r"\.".join(r"\d+" if p == "*" else re.escape(p) for p in full.split(".")))
        dots = full.count(".")
        hits = tuple([n for n in names if n.count(".") == dots and pattern.fullmatch(n)]
                     for names in (module_names, param_names))
        if any(hits):
            break
    return hits  # type: ignore[return-value]


def _patterns(model: nn.Module) -> list[str]:
    """Module paths and non weight/bias parameters, numeric components as ``*`` (as keys are)."""
    names = [n for n, _ in model.named_modules() if n]
    names += [n for n, _ in model.named_parameters() if n.rpartition(".")[2] not in ("weight", "bias")]
    return list(dict.fromkeys(re.sub(r"(?<![^.])\d+(?![^.])", "*", n) for n in names))


def closest_paths(key: str, patterns: list[str], prefix: str = "", n: int = 3) -> list[str]:
    """The ``n`` patterns most like ``key``, each also compared without the base ``prefix``."""
    def score(pattern: str) -> float:
        bare = pattern[len(prefix) + 1:] if prefix and pattern.startswith(prefix + ".") else pattern
        return max(difflib.SequenceMatcher(None, key, p).ratio() for p in (pattern, bare))

    return sorted(patterns, key=lambda p: -score(p))[:n]


def check_some_key_matches(model: nn.Module, plan: Mapping, unused, *, what: str = "plan") -> None:
    """``PlanError`` when no key of a non-empty ``plan`` matches: every rank would hold the whole
    model, which no one means. With one key matching, the others are skipped."""
    if not plan or len(unused) < len(plan):
        return
    patterns, prefix = _patterns(model), adapter_for(model).base_prefix(model)
    shown = [f"{k!r} (closest: {', '.join(map(repr, closest_paths(k, patterns, prefix)))})"
             for k in list(plan)[:3]]
    more = f", and {len(plan) - 3} more" if len(plan) > 3 else ""
    base = f"; a key written for the base model also matches under {prefix + '.'!r}" if prefix else ""
    own = (f", or pass plan='auto' for the plan {type(model).__name__} ships"
           if what == "plan" and adapter_for(model).shipped_plan(model, "tp") else "")
    raise PlanError(
        f"none of the {what}'s {len(plan)} keys matches a module or parameter of {type(model).__name__}, so "
        f"nothing would be sharded and every rank would hold the whole model: {'; '.join(shown)}{more}. "
        f"Write each key as the model names its modules, with '*' for a layer index{base}{own}")


# -- pairing of split projections ----------------------------------------------------------

# (producers, consumers) relative to one module: a colwise producer's sibling consumer must be
# rowwise, and the reverse. A name may sit in two families (GPT-2's c_proj): only siblings pair.
FAMILIES: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "q_b_proj", "kv_b_proj", "c_attn",
      "Wqkv", "wqkv", "wq", "wk", "wv", "qkv", "q", "k", "v"),
     ("o_proj", "out_proj", "dense", "c_proj", "wo", "Wo", "o", "out")),
    (("to_q", "to_k", "to_v", "to_qkv", "to_qkv_mlp_proj"), ("to_out.0", "to_out")),
    (("add_q_proj", "add_k_proj", "add_v_proj"), ("to_add_out",)),
    (("gate_proj", "up_proj", "gate_up_proj", "fc1", "fc_in", "c_fc", "w1", "w3", "dense_h_to_4h",
      "linear_in", "wi", "wi_0", "wi_1", "gate_up", "up", "net.0.proj"),
     ("down_proj", "fc2", "fc_out", "c_proj", "w2", "dense_4h_to_h", "linear_out", "wo", "down", "net.2")),
)


def _weight_spec(specs: Mapping[str, ShardSpec], path: str) -> ShardSpec | None:
    """The spec of ``path``'s weight, or of ``path`` itself, or None."""
    for name in (f"{path}.weight", path):
        if name in specs:
            return specs[name]
    return None


def _splits(path: str, specs, shapes, styles, role: str) -> bool:
    """Whether tp splits ``path``'s output features (producers: dim ``ndim - 2``, not gathered
    again) or its input features (consumers: the last dim, from an input arriving split)."""
    spec, ndim = _weight_spec(specs, path), len(_shape(shapes, path))
    if spec is None or spec.replicated or spec.axis != "tp" or ndim < 2:
        return False
    style = styles.get(path)
    if role == "producers":
        return spec.dim == ndim - 2 and not (style is not None and style.gather_output)
    return spec.dim == ndim - 1 and not (style is not None and style.split_input)


def check_pairs(specs: Mapping[str, ShardSpec], shapes: Mapping[str, tuple[int, ...]],
                styles: Mapping[str, Style], keys: Mapping[str, str], degree: int) -> None:
    """``PlanError`` naming both modules where a split producer's sibling consumer does not
    split its input, or a consumer does while its producers are whole (``FAMILIES``)."""
    if degree == 1:
        return
    for producers, consumers in FAMILIES:
        for parent, found in _siblings(specs, producers, consumers).items():
            _check_family(parent, found, specs, shapes, styles, keys)


def _siblings(names: Collection[str], producers, consumers) -> dict[str, dict[str, list[str]]]:
    """``{parent: {"producers": [paths], "consumers": [paths]}}`` of the family in ``names``."""
    by_leaf: dict[str, list[tuple[str, str]]] = {}  # one dict lookup per tensor, not one per name
    for role, rels in (("producers", producers), ("consumers", consumers)):
        for rel in rels:
            by_leaf.setdefault(rel.rpartition(".")[2], []).append((role, rel))
    out: dict[str, dict[str, list[str]]] = {}
    for name in names:
        path = name[: -len(".weight")] if name.endswith(".weight") else name
        for role, rel in by_leaf.get(path.rpartition(".")[2], ()):
            if path == rel or path.endswith("." + rel):
                group = out.setdefault(path[: -len(rel)].rstrip("."), {"producers": [], "consumers": []})
                if path not in group[role]:
                    group[role].append(path)
    return out


def _check_family(parent: str, found: dict, specs, shapes, styles, keys) -> None:
    producers = [p for p in found["producers"] if len(_shape(shapes, p)) >= 2]
    consumers = [c for c in found["consumers"] if len(_shape(shapes, c)) >= 2]
    split_out = [p for p in producers if _splits(p, specs, shapes, styles, "producers")]
    split_in = [c for c in consumers if _splits(c, specs, shapes, styles, "consumers")]
    if split_out and consumers and not split_in:
        p, c = split_out[0], consumers[0]
        key = _key(keys, p)
        raise PlanError(
            f"plan key {key!r} shards {p!r} colwise, so its output stays split over the ranks, but its "
            f"consumer {c!r} is {_what(c, specs, styles)}: it would get part of its input features and the "
            f"forward would fail. Pair them: add {{{_sibling_key(key, p, c)!r}: 'rowwise'}} to the plan "
            f"(or give {p!r} 'colwise_gather_output' to make its output whole)")
    if split_in and producers and not split_out:
        c, p = split_in[0], producers[0]
        key = _key(keys, c)
        raise PlanError(
            f"plan key {key!r} shards {c!r} rowwise, so it expects its input split over the ranks, but "
            f"{', '.join(map(repr, producers))}, which produce that input, are whole: the forward would "
            f"fail. Shard them colwise (add {{{_sibling_key(key, c, p)!r}: 'colwise'}}, and the same for "
            f"the others), or give {c!r} 'rowwise_split_input' to split a whole input itself")


def _key(keys, path: str) -> str:
    return keys[path] if path in keys else keys.get(f"{path}.weight", path)


def _shape(shapes, path: str) -> tuple[int, ...]:
    return shapes.get(f"{path}.weight", shapes.get(path, ()))


def _what(path: str, specs, styles) -> str:
    style = styles.get(path)
    if style is not None and style.split_input:
        return f"{style.source!r}, which takes a whole input and splits it itself"
    spec = _weight_spec(specs, path)
    return "not in the plan" if spec is None or spec.replicated else f"sharded as {spec}, not rowwise"


def _sibling_key(key: str, path: str, sibling: str) -> str:
    """The plan key of ``sibling`` written like ``key`` (its '*'s and prefix kept)."""
    parent = path.rpartition(".")[0] if "." in path else ""
    while parent and not sibling.startswith(parent + "."):
        parent = parent.rpartition(".")[0]
    tail_old = path[len(parent) + 1:] if parent else path
    tail_new = sibling[len(parent) + 1:] if parent else sibling
    head = key.split(".")[: len(key.split(".")) - len(tail_old.split("."))]
    return ".".join(head + tail_new.split("."))


# -- degrees --------------------------------------------------------------------------------

HEAD_ATTRS = ("num_heads", "heads", "num_attention_heads", "num_key_value_heads",
               "num_kv_heads", "n_heads", "n_kv_heads")
_ATTENTION = re.compile(r"attn|attention|q_proj|k_proj|v_proj|qkv|to_q|to_k|to_v")


def head_counts(model: nn.Module, sharded: list[str]) -> list[tuple[str, str, int, str]]:
    """``(owner, attribute, count, sharded path)`` of each head count on the config or on a
    module above a sharded projection."""
    if not sharded:
        return []
    config = getattr(model, "config", None)
    # the root's from its config: diffusers warns on config attributes read off the model
    owners = [("config", config)] if config is not None else [("", model)]
    owners += [(n, m) for n, m in model.named_modules() if n]
    out = []
    for name, owner in owners:
        near = [p for p in sharded if name in ("", "config") or p.startswith(name + ".")]
        if not near:
            continue
        for attr in HEAD_ATTRS:
            try:
                value = getattr(owner, attr, None)
            except Exception:  # noqa: BLE001 - a per-layer config attribute refuses a global read
                continue
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                path = next((p for p in near if _ATTENTION.search(p)), near[0])
                out.append((f"model.{name}" if name else "model", attr, value, path))
    return out


def check_degrees(tensors: list, counts: list, keys: dict, degrees: dict[str, int],
                  others: Callable[[dict[str, int]], None]) -> None:
    """``ShardingError`` unless each axis's degree splits its ``tensors`` (``(shape, spec, name,
    key)``) and, for tp, the head ``counts``; it lists the degrees passing these and ``others``."""
    for axis in ("tp", "ep"):
        error = _error_at(tensors, counts, keys, axis, degrees[axis])
        if error is not None:
            ok = _passing(tensors, counts, keys, degrees, axis, others)
            # from None: the cause's hint (one dim's divisors) would contradict the list
            raise ShardingError(f"{error}. Degrees that pass every check of this plan: "
                                f"{', '.join(map(str, ok))}") from None


def _passing(tensors, counts, keys, degrees: dict[str, int], axis: str, others) -> list[int]:
    ok = []
    for d in dividing_degrees([(shape, spec) for shape, spec, _, _ in tensors if spec.axis == axis]):
        if d > 1:
            if _error_at(tensors, counts, keys, axis, d) is not None:
                continue
            try:
                others({**degrees, axis: d})
            except PlanError:
                continue
        ok.append(d)
    return ok


def _error_at(tensors, counts, keys, axis: str, degree: int) -> str | None:
    for shape, spec, name, key in tensors:
        if spec.axis != axis:
            continue
        try:
            check_shardable(shape, spec, degree)
        except ShardingError:
            sizes = block_sizes(shape, spec)
            blocks = f" (packed blocks of sizes {list(sizes)})" if spec.packed else ""
            return (f"plan key {key!r}, tensor {name!r} of shape {shape}: dim {spec.dim} of size "
                    f"{shape[spec.dim]}{blocks} cannot be split over degree {degree}")
    for where, attr, value, path in counts if axis == "tp" and degree > 1 else ():
        if value % degree:
            return (f"{where}.{attr} = {value} is not divisible by degree {degree}, but plan key "
                    f"{keys[path]!r} shards {path!r}: each rank must own whole heads")
    return None


__all__ = [
    "FAMILIES", "HEAD_ATTRS", "PackedColwise", "PackedRowwise", "ResolvedPlan", "SUPPORTED_STYLES", "Style",
    "match_plan", "normalize_style", "plan_from_model", "plan_summary",
    "register_model_check", "resolve_plan", "without_tp",
]
