"""Plans: from ``{module path: style}`` to one ``ShardSpec`` per tensor of the model.

A plan key names a module; one ``*`` expands the items of a ``ModuleList`` (or
``Sequential``). A style is a string as transformers and diffusers write them
(``"colwise"``, ``"rowwise"``, ``"colwise_gather_output"``, ``"embedding_rowwise"``, ...),
a ``PackedColwise`` / ``PackedRowwise`` object (ours, or diffusers' classes of the same
role), or one of torch's ``ColwiseParallel`` / ``RowwiseParallel``. Everything is
normalised to a ``Style`` and validated here, on a meta model, before any process group
is touched. Pure: no torch.distributed, no file I/O.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from shardwise.core.spec import ShardSpec, check_shardable
from shardwise.errors import PlanError, ShardingError


@dataclass(frozen=True)
class _Packed:
    blocks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.blocks is not None:
            object.__setattr__(self, "blocks", _check_blocks(self.blocks, type(self).__name__))


@dataclass(frozen=True)
class PackedColwise(_Packed):
    """Column-wise split of a fused projection, each packed block on its own.

    ``blocks`` are ratios of the output rows (``[1, 1]`` for gate|up, ``[1, 1, 1, 3, 3]``
    for fused q|k|v|gate|up); ``None`` reads ``module._tp_packed_col_blocks``.

    >>> PackedColwise([1, 1])
    PackedColwise(blocks=(1, 1))
    """


@dataclass(frozen=True)
class PackedRowwise(_Packed):
    """Row-wise split of a projection whose input concatenates several blocks.

    ``blocks`` are ratios of the input columns (``[1, 3]`` when the input is an attention
    output next to an MLP hidden state 3x as wide); ``None`` reads
    ``module._tp_packed_row_blocks``.

    >>> PackedRowwise([1, 3])
    PackedRowwise(blocks=(1, 3))
    """


def _check_blocks(blocks, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(b) for b in blocks)
    except (TypeError, ValueError):
        raise PlanError(f"{what} blocks must be a list of positive ints, got {blocks!r}") from None
    if not out or any(b <= 0 for b in out) or any(int(b) != b for b in blocks):
        raise PlanError(f"{what} blocks must be a non-empty list of positive ints, got {blocks!r}")
    return out


@dataclass(frozen=True)
class Style:
    """A normalised plan entry.

    ``kind`` is ``"colwise"`` (output features split), ``"rowwise"`` (input features
    split; the bias is replicated and added once, after the reduction) or ``"replicate"``.
    ``blocks`` are packed ratios (``None``: read them off the module). ``gather_output``
    all-gathers a colwise output back to full size; ``split_input`` takes a replicated
    input and splits it locally before a rowwise matmul.
    """

    kind: str
    blocks: tuple[int, ...] | None = (1,)
    gather_output: bool = False
    split_input: bool = False
    source: str = ""


_STRINGS: dict[str, Style] = {
    "colwise": Style("colwise"),
    "local_colwise": Style("colwise"),
    "colwise_rep": Style("colwise", gather_output=True),
    "colwise_gather_output": Style("colwise", gather_output=True),
    "rowwise": Style("rowwise"),
    "local_rowwise": Style("rowwise"),
    "rowwise_split_input": Style("rowwise", split_input=True),
    "embedding_rowwise": Style("rowwise"),
    "vocab_parallel": Style("rowwise"),
    "embedding_colwise": Style("colwise"),
    "packed_colwise": Style("colwise", blocks=None),
    "packed_rowwise": Style("rowwise", blocks=None),
    "replicate": Style("replicate"),
    "replicated": Style("replicate"),
    "replicated_with_grad_allreduce": Style("replicate"),
    "local": Style("replicate"),
}
SUPPORTED_STYLES = tuple(sorted(_STRINGS)) + ("PackedColwise(blocks)", "PackedRowwise(blocks)")
# Default packed layout when a "packed_*" string names no blocks and the module carries
# none: transformers uses it for gate|up, two equal halves.
_DEFAULT_PACKED = (1, 1)


def normalize_style(style, *, key: str = "") -> Style:
    """A plan value (string, packed object, torch ParallelStyle) as a ``Style``.

    >>> normalize_style("colwise_gather_output")
    Style(kind='colwise', blocks=(1,), gather_output=True, split_input=False, source='colwise_gather_output')
    """
    where = f" for plan key {key!r}" if key else ""
    if isinstance(style, Style):
        return style
    if isinstance(style, str):
        if style in _STRINGS:
            s = _STRINGS[style]
            return Style(s.kind, s.blocks, s.gather_output, s.split_input, source=style)
        raise PlanError(
            f"unsupported style {style!r}{where}; supported: {', '.join(SUPPORTED_STYLES)}"
        )
    cls = type(style).__name__
    blocks = getattr(style, "blocks", None)
    if cls in ("PackedColwise", "PackedColwiseParallel"):
        b = None if blocks is None else _check_blocks(blocks, cls)
        return Style("colwise", b, source=f"{cls}({list(b) if b else None})")
    if cls in ("PackedRowwise", "PackedRowwiseParallel"):
        b = None if blocks is None else _check_blocks(blocks, cls)
        return Style("rowwise", b, source=f"{cls}({list(b) if b else None})")
    if cls == "ReplicatedInputRowwiseParallel":  # diffusers' name for rowwise_split_input
        return Style("rowwise", split_input=True, source=cls)
    if cls in ("ColwiseParallel", "RowwiseParallel"):
        return _from_torch_style(style, cls)
    raise PlanError(
        f"unsupported style {style!r}{where}; supported: {', '.join(SUPPORTED_STYLES)}"
    )


def _from_torch_style(style, cls: str) -> Style:
    # torch keeps layouts as 1-tuples of placements
    layouts = getattr(style, "output_layouts" if cls == "ColwiseParallel" else "input_layouts", ())
    first = layouts[0] if isinstance(layouts, tuple) and layouts else layouts
    replicated = type(first).__name__ == "Replicate"
    if cls == "ColwiseParallel":
        return Style("colwise", gather_output=replicated, source=cls)
    return Style("rowwise", split_input=replicated, source=cls)


class ResolvedPlan(dict):
    """``{tensor name: ShardSpec}`` for every parameter and persistent buffer of a model.

    Also carries ``styles`` (``{module path: Style}`` with blocks filled in), ``keys``
    (``{module path: the plan key that claimed it}``), ``aliases`` (tied tensors: extra
    name -> the name kept) and the ``degree`` it was validated for.
    """

    def __init__(self, specs, *, styles, keys, aliases, degree):
        super().__init__(specs)
        self.styles: dict[str, Style] = styles
        self.keys: dict[str, str] = keys
        self.aliases: dict[str, str] = aliases
        self.degree: int = degree


def expand_plan(model: nn.Module, plan: Mapping) -> dict[str, tuple[str, object]]:
    """``{module path: (plan key, style)}``, expanding one ``*`` per key over a ModuleList."""
    if not isinstance(plan, Mapping):
        raise PlanError(f"a plan must be a dict of module path -> style, got {type(plan).__name__}")
    claimed: dict[str, tuple[str, object]] = {}
    for key, style in plan.items():
        if not isinstance(key, str) or not key:
            raise PlanError(f"plan keys must be module paths (non-empty strings), got {key!r}")
        for path in _expand_key(model, key):
            if path in claimed:
                raise PlanError(
                    f"plan keys {claimed[path][0]!r} and {key!r} both claim module {path!r}; "
                    "keep one entry per module"
                )
            claimed[path] = (key, style)
    return claimed


def _expand_key(model: nn.Module, key: str) -> list[str]:
    if key.count("*") > 1:
        raise PlanError(f"plan key {key!r} has more than one '*'; use one '*' per key")
    modules = dict(model.named_modules())
    if "*" not in key:
        if key not in modules:
            raise PlanError(f"plan key {key!r} matches no module{_close(key, modules)}")
        return [key]
    prefix, _, suffix = key.partition("*")
    prefix, suffix = prefix.rstrip("."), suffix.lstrip(".")
    container = modules.get(prefix)
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        what = "no module" if container is None else f"a {type(container).__name__}"
        raise PlanError(
            f"plan key {key!r}: '*' must follow a ModuleList, but {prefix!r} is {what}"
            f"{_close(prefix, modules) if container is None else ''}"
        )
    paths = [f"{prefix}.{i}.{suffix}" if suffix else f"{prefix}.{i}" for i in range(len(container))]
    missing = [p for p in paths if p not in modules]
    if missing or not paths:
        raise PlanError(
            f"plan key {key!r} matches no module at {missing[0] if missing else prefix + '.*'!r}"
            f"{_close(missing[0], modules) if missing else ''}"
        )
    return paths


def _close(name: str, modules) -> str:
    near = difflib.get_close_matches(name, [m for m in modules if m], n=3)
    return f"; did you mean {', '.join(map(repr, near))}?" if near else ""


def _module_blocks(module: nn.Module, style: Style, path: str, key: str) -> tuple[int, ...]:
    if style.blocks is not None:
        return style.blocks
    attr = "_tp_packed_col_blocks" if style.kind == "colwise" else "_tp_packed_row_blocks"
    blocks = getattr(module, attr, None)
    if blocks is None:
        if style.source.startswith("packed_"):
            return _DEFAULT_PACKED
        raise PlanError(
            f"plan key {key!r} ({style.source}) gives no blocks and module {path!r} has no "
            f"{attr}; pass the blocks, e.g. PackedColwise([1, 1])"
        )
    return _check_blocks(blocks, f"{path}.{attr}")


def _param_specs(module: nn.Module, style: Style, blocks, path: str, key: str) -> dict[str, ShardSpec]:
    """Specs of the module's own tensors under ``style``."""
    if style.kind == "replicate":
        return {}
    is_embedding = isinstance(module, nn.Embedding)
    if not (isinstance(module, nn.Linear) or is_embedding):
        raise PlanError(
            f"plan key {key!r} applies {style.source!r} to {path!r}, a {type(module).__name__}; "
            "sharded styles apply to nn.Linear and nn.Embedding modules only"
        )
    if is_embedding and (len(blocks) > 1 or style.split_input):
        raise PlanError(f"plan key {key!r}: style {style.source!r} does not apply to the embedding {path!r}")
    if is_embedding:
        # colwise = split the embedding dim; rowwise = split the vocabulary.
        return {"weight": ShardSpec(dim=1 if style.kind == "colwise" else 0)}
    specs = {"weight": ShardSpec(dim=0 if style.kind == "colwise" else 1, blocks=blocks)}
    if getattr(module, "bias", None) is not None:
        specs["bias"] = ShardSpec(dim=0, blocks=blocks) if style.kind == "colwise" else ShardSpec()
    return specs


_HEAD_ATTRS = ("num_heads", "heads", "num_attention_heads", "num_key_value_heads",
               "num_kv_heads", "n_heads", "n_kv_heads")


def _check_heads(model: nn.Module, styles: Mapping[str, Style], keys, degree: int) -> None:
    """The degree must divide every attention head count next to a sharded projection."""
    sharded = [p for p, s in styles.items() if s.kind != "replicate"]
    if degree == 1 or not sharded:
        return
    owners = [("", model)] + [(n, m) for n, m in model.named_modules() if n]
    config = getattr(model, "config", None)
    if config is not None:
        owners.insert(0, ("config", config))
    for name, owner in owners:
        if name != "config" and name and not any(p.startswith(name + ".") for p in sharded):
            continue
        for attr in _HEAD_ATTRS:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0 and value % degree:
                key = next((keys[p] for p in sharded if not name or name == "config"
                            or p.startswith(name + ".")), "")
                where = f"model.{name}" if name else "model"
                raise ShardingError(
                    f"{where}.{attr} = {value} is not divisible by degree {degree} "
                    f"(needed by plan key {key!r}): each rank must own whole heads; "
                    f"choose a degree that divides {value}"
                )


def resolve_plan(model: nn.Module, plan: Mapping, degree: int) -> ResolvedPlan:
    """``{tensor name: ShardSpec}`` for every parameter and persistent buffer of ``model``.

    Works on a meta model (only shapes and module attributes are read). Validates that
    every key matches modules, no module is claimed twice, styles are supported, and
    ``degree`` divides every sharded dim, every packed block and the head counts the
    model exposes. Tensors outside the plan are replicated.

    >>> specs = resolve_plan(model, {"layers.*.mlp.up": "colwise"}, degree=2)  # doctest: +SKIP
    >>> specs["layers.0.mlp.up.weight"]                                         # doctest: +SKIP
    ShardSpec(dim=0, blocks=(1,))
    """
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise PlanError(f"degree must be a positive int, got {degree!r}")
    claimed = expand_plan(model, plan)
    styles: dict[str, Style] = {}
    keys: dict[str, str] = {}
    owned: dict[str, tuple[ShardSpec, str]] = {}
    for path, (key, raw) in claimed.items():
        style = normalize_style(raw, key=key)
        module = model.get_submodule(path)
        blocks = _module_blocks(module, style, path, key) if style.kind != "replicate" else (1,)
        style = Style(style.kind, blocks, style.gather_output, style.split_input, style.source)
        if style.gather_output and len(blocks) > 1:
            raise PlanError(f"plan key {key!r}: gathering the output of a packed projection is not supported")
        styles[path], keys[path] = style, key
        for pname, spec in _param_specs(module, style, blocks, path, key).items():
            tensor = getattr(module, pname)
            name = f"{path}.{pname}"
            try:
                check_shardable(tuple(tensor.shape), spec, degree)
            except ShardingError as e:
                raise ShardingError(f"plan key {key!r}, tensor {name!r} of shape "
                                    f"{tuple(tensor.shape)}: {e}") from e
            if id(tensor) in owned and owned[id(tensor)][0] != spec:
                other = owned[id(tensor)]
                raise PlanError(f"plan key {key!r} shards {name!r} as {spec}, but the same tied tensor "
                                f"is {other[1]!r} sharded as {other[0]}; plan tied modules alike")
            owned[id(tensor)] = (spec, name)
    _check_heads(model, styles, keys, degree)

    specs: dict[str, ShardSpec] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first_name:  # a tied weight: one tensor, several names
            kept = first_name[id(tensor)]
            aliases[name] = kept
            _check_tied(name, kept, owned.get(id(tensor)), claimed)
            continue
        first_name[id(tensor)] = name
        specs[name] = owned[id(tensor)][0] if id(tensor) in owned else ShardSpec()
    return ResolvedPlan(specs, styles=styles, keys=keys, aliases=aliases, degree=degree)


def _check_tied(name: str, kept: str, owner, claimed) -> None:
    """A sharded tied tensor needs every module using it planned, or one forward is wrong."""
    if owner is None:
        return
    for n in (name, kept):
        if n.rpartition(".")[0] not in claimed:
            raise PlanError(
                f"{n!r} is tied to {owner[1]!r}, which the plan shards as {owner[0]}, but module "
                f"{n.rpartition('.')[0]!r} has no plan entry; plan both tied modules alike"
            )


def plan_from_model(model: nn.Module) -> dict:
    """The plan a model ships: diffusers/transformers ``_tp_plan`` and the ``base_model_tp_plan``
    of its config, with base-model keys prefixed by the base model's attribute name."""
    plan: dict = {}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if base:
        prefix = getattr(model, "base_model_prefix", "")
        inner = getattr(model, prefix, None) if prefix else None
        for k, v in base.items():
            plan[f"{prefix}.{k}" if inner is not None and inner is not model else k] = v
    own = getattr(model, "_tp_plan", None)
    if own:
        plan.update(own)
    return plan


def plan_summary(resolved: ResolvedPlan) -> dict[str, str]:
    """``{module path: style source}``, for logs and the informational JSON of a checkpoint."""
    return {p: s.source or s.kind for p, s in resolved.styles.items()}


__all__ = [
    "PackedColwise", "PackedRowwise", "ResolvedPlan", "SUPPORTED_STYLES", "Style",
    "expand_plan", "normalize_style", "plan_from_model", "plan_summary", "resolve_plan",
]
