"""A plan dict decoded against a model (pure): each value (transformers' and diffusers' names,
torch's and diffusers' style objects, read by name) as one ``Style`` (docs/plans.md: collectives),
each key as the module and parameter paths it matches (:func:`match_plan`)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from torch import nn

from shardwise.core.adapter import adapter_for
from shardwise.core.quant_layout import MXFP4_SUFFIXES
from shardwise.core.walk import named_modules, named_parameters
from shardwise.errors import PlanError


@dataclass(frozen=True)
class _Packed:
    blocks: Sequence[int] | None = None  # any sequence in; a tuple once constructed

    def __post_init__(self) -> None:
        if self.blocks is not None:
            object.__setattr__(self, "blocks", check_blocks(self.blocks, type(self).__name__))


@dataclass(frozen=True)
class PackedColwise(_Packed):
    """Column-wise split of a fused projection, each block of output-row ratios ``blocks``
    (``[1, 1]``: gate|up) on its own; ``None`` reads ``module._tp_packed_col_blocks``.

    >>> PackedColwise([1, 1])
    PackedColwise(blocks=(1, 1))
    """


@dataclass(frozen=True)
class PackedRowwise(_Packed):
    """Row-wise split of a projection whose input concatenates blocks of input-column ratios
    ``blocks``; ``None`` reads ``module._tp_packed_row_blocks``.

    >>> PackedRowwise([1, 3])
    PackedRowwise(blocks=(1, 3))
    """


def check_blocks(blocks, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(b) for b in blocks)
    except (TypeError, ValueError):
        raise PlanError(f"{what} blocks must be a list of positive ints, got {blocks!r}") from None
    if not out or any(b <= 0 for b in out) or any(int(b) != b for b in blocks):
        raise PlanError(f"{what} blocks must be a non-empty list of positive ints, got {blocks!r}")
    return out


@dataclass(frozen=True)
class Style:
    """A normalised plan entry: ``kind`` ``"colwise"`` (output features split), ``"rowwise"``
    (input features split, bias added once after the sum) or ``"replicate"``; ``blocks``: packed
    ratios (None: the module's); ``gather_output`` / ``split_input``: a whole output / input;
    ``embedding``: a parameter key splits dim 0 (rowwise) or 1; ``axis``: ``"tp"`` or ``"ep"``.
    ``forward``: what ``local_tp`` does around the module's own code (``linear``, ``none``,
    ``grad_allreduce``, ``local_params``, ``reduce_output``, ``moe_experts``, ``divide_input``,
    ``mla_kv_a`` of width ``rope_dim``, ``local_heads``, ``ep_experts`` of ``num_experts``); docs/plans.md."""

    kind: str
    blocks: tuple[int, ...] | None = (1,)
    gather_output: bool = False
    split_input: bool = False
    source: str = ""
    forward: str = "linear"
    embedding: bool = False
    rope_dim: int | None = None
    num_experts: int | None = None
    axis: str = "tp"

    @property
    def sharded(self) -> bool:
        return self.kind != "replicate"


_STRINGS: dict[str, Style] = {
    "colwise": Style("colwise"),
    "local_colwise": Style("colwise"),
    "colwise_rep": Style("colwise", gather_output=True),
    "colwise_gather_output": Style("colwise", gather_output=True),
    "rowwise": Style("rowwise"),
    "local_rowwise": Style("rowwise"),
    "rowwise_split_input": Style("rowwise", split_input=True),
    "rowwise_rep": Style("rowwise", split_input=True),
    "embedding_rowwise": Style("rowwise", embedding=True),
    "vocab_parallel": Style("rowwise", embedding=True),
    "embedding_colwise": Style("colwise", embedding=True),
    "packed_colwise": Style("colwise", blocks=None),
    "packed_rowwise": Style("rowwise", blocks=None),
    "replicate": Style("replicate", forward="none"),
    "replicated": Style("replicate", forward="none"),
    "local": Style("replicate", forward="none"),
    "replicated_with_grad_allreduce": Style("replicate", forward="grad_allreduce"),
    # transformers' sequence_parallel sums partial gradients of a sequence shard; shardwise never
    # splits the sequence, so a sum over tp would count the whole gradient degree times
    "sequence_parallel": Style("replicate", forward="none"),
    "local_params": Style("replicate", forward="local_params"),
    "all_reduce": Style("replicate", forward="reduce_output"),
    "moe_tp_experts": Style("replicate", forward="moe_experts"),
    "moe_identity_expert": Style("replicate", forward="divide_input"),
    "mla_kv_a_proj": Style("replicate", forward="mla_kv_a"),
    # shardwise's own: an attention module whose forward shapes its split projections with its
    # head-count attributes (UMT5's q.view(b, -1, self.n_heads, d)) gets them divided by the degree
    "local_heads": Style("replicate", forward="local_heads"),
    # transformers 5.25's per-head styles (minicpm5_moe's k/v): a rank owns whole heads. Where the
    # degree divides the head count they are colwise / rowwise, which is all shardwise serves:
    # transformers replicates heads over ranks otherwise, and the head-count check refuses that
    # degree here, naming those that work
    "unit_colwise": Style("colwise"),
    "unit_rowwise": Style("rowwise"),
    # an expert-parallel plan's (transformers' base_model_ep_plan), on the ep axis
    "grouped_gemm": Style("colwise", axis="ep"),
    "ep_dispatch_experts": Style("replicate", forward="ep_experts", axis="ep"),
}
SUPPORTED_STYLES = tuple(sorted(_STRINGS)) + ("PackedColwise(blocks)", "PackedRowwise(blocks)")
# a "packed_*" string's blocks when the module carries none: transformers' gate|up halves
DEFAULT_PACKED = (1, 1)


# each named style once, its name as its source (styles are frozen: one object serves every key)
_NAMED: dict[str, Style] = {name: replace(style, source=name) for name, style in _STRINGS.items()}


def normalize_style(style, *, key: str = "") -> Style:
    """A plan value (string, packed object, torch ParallelStyle) as a ``Style``; else ``PlanError``.

    >>> normalize_style("colwise_gather_output").gather_output
    True
    """
    where = f" for plan key {key!r}" if key else ""
    if isinstance(style, Style):
        return style
    if isinstance(style, str) and style in _NAMED:
        return _NAMED[style]
    cls = type(style).__name__  # an unknown string falls through to the error below
    blocks = getattr(style, "blocks", None)
    if cls in ("PackedColwise", "PackedColwiseParallel", "PackedRowwise", "PackedRowwiseParallel"):
        b = None if blocks is None else check_blocks(blocks, cls)
        kind = "colwise" if "Colwise" in cls else "rowwise"
        return Style(kind, b, source=f"{cls}({list(b) if b else None})")
    if cls == "ReplicatedInputRowwiseParallel":  # diffusers' name for rowwise_split_input
        return Style("rowwise", split_input=True, source=cls)
    if cls in ("ColwiseParallel", "RowwiseParallel"):
        # torch keeps layouts as 1-tuples of placements
        layouts = getattr(style, "output_layouts" if cls == "ColwiseParallel" else "input_layouts", ())
        first = layouts[0] if isinstance(layouts, tuple) and layouts else layouts
        replicated = type(first).__name__ == "Replicate"
        if cls == "ColwiseParallel":
            return Style("colwise", gather_output=replicated, source=cls)
        return Style("rowwise", split_input=replicated, source=cls)
    raise PlanError(f"unsupported style {style!r}{where}; supported: {', '.join(SUPPORTED_STYLES)}")


# -- keys: matched against the model's paths ------------------------------------------------

def match_plan(model: nn.Module, plan: Mapping, *, strict: bool = False, what: str = "plan"):
    """``({module path: (key, style)}, {parameter: (key, style)}, unmatched keys)``: each ``*``
    is one numeric path component; a key also matches under the adapter's ``base_prefix``.
    ``PlanError`` for a bad key or style, and when no key of a non-empty ``plan`` matches (every
    rank would hold the whole model, which no one means); one key matching, the others are skipped."""
    if not isinstance(plan, Mapping):
        raise PlanError(f"a plan must be a dict of module path -> style, got {type(plan).__name__}")
    prefix = adapter_for(model).base_prefix(model)
    # Each key as written, under the base prefix, and both as an MXFP4 `x_blocks` (the key names
    # `x`, as transformers): every module and parameter name walks one trie of them, once.
    variants = {key: [f"{head}{key}{tail}" for tail in ("", MXFP4_SUFFIXES[0])
                      for head in (("", f"{prefix}.") if prefix else ("",))]
                for key in plan if isinstance(key, str) and key}
    patterns = [v for vs in variants.values() for v in vs]
    module_hits = dict(zip(patterns, matches(patterns, (n for n, _ in named_modules(model))), strict=True))
    param_hits = dict(zip(patterns, matches(patterns, named_parameters(model)), strict=True))
    modules: dict[str, tuple[str, object]] = {}
    params: dict[str, tuple[str, object]] = {}
    unused: list[str] = []
    for key, style in plan.items():
        if not isinstance(key, str) or not key:
            raise PlanError(f"plan keys must be module or parameter paths (non-empty strings), got {key!r}")
        normalize_style(style, key=key)  # an unknown style is an error even where nothing matches
        half = len(variants[key]) // 2
        hits = _first_hit(variants[key][:half], module_hits, param_hits)
        if not any(hits):  # MXFP4 `x` held as `x_blocks` + `x_scales`: parameters only
            hits = ([], _first_hit(variants[key][half:], module_hits, param_hits)[1])
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
    if not plan or len(unused) < len(plan):
        return modules, params, unused
    patterns = _patterns(model)
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


def _first_hit(variants: list[str], module_hits, param_hits) -> tuple[list[str], list[str]]:
    """The module and parameter names of the first variant that matches any (else the last's)."""
    for full in variants:
        hits = (module_hits[full], param_hits[full])
        if any(hits):
            break
    return hits


def matches(patterns: list[str], names) -> list[list[str]]:
    """For each pattern (a dotted path, ``*`` one numeric component), the ``names`` it matches in
    full, in their order. Each name walks a trie of the patterns' components once: linear in
    names, whatever the number of keys (STYLE.md rule 22)."""
    root: tuple[dict, list[int]] = ({}, [])  # (children by component, patterns ending here)
    for i, pattern in enumerate(patterns):
        node = root
        for part in pattern.split("."):
            node = node[0].setdefault(part, ({}, []))
        node[1].append(i)
    out: list[list[str]] = [[] for _ in patterns]
    reached: dict[str, list] = {}  # {path: the trie nodes it reaches}: a name steps on from its parent's

    def nodes_of(path: str) -> list:
        if path in reached:
            return reached[path]
        parent, dot, part = path.rpartition(".")
        nodes = nodes_of(parent) if dot else [root]
        # a component matches its own text, and '*' if it is a number ('*' itself is no name)
        nodes = [c for n in nodes for c in (n[0].get(part) if part != "*" else None,
                                             n[0].get("*") if part.isdecimal() else None)
                 if c is not None] if nodes else nodes
        reached[path] = nodes
        return nodes

    for name in names:
        for node in nodes_of(name):
            for i in node[1]:
                out[i].append(name)
    return out


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


__all__ = [
    "DEFAULT_PACKED", "PackedColwise", "PackedRowwise", "SUPPORTED_STYLES", "Style",
    "check_blocks", "closest_paths", "match_plan", "matches", "normalize_style",
]
