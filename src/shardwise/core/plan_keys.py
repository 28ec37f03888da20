"""Plan keys: which modules and parameters a key names.

Matched the way transformers matches them (``transformers/distributed``): each ``*`` stands
for one numeric path component, a key may name a module or a parameter, a key written for
the base model also matches under the prefix the model's adapter gives (``core.adapter``:
``base_model_prefix`` for a Hugging Face model), and keys that match nothing are returned,
not raised (unless ``strict``). Pure: no torch.distributed, no file I/O.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping

from torch import nn

from shardwise.core.adapter import adapter_for
from shardwise.core.quant_layout import MXFP4_SUFFIXES
from shardwise.core.styles import normalize_style
from shardwise.errors import PlanError


def _key_pattern(key: str) -> re.Pattern:
    parts = [r"\d+" if p == "*" else re.escape(p) for p in key.split(".")]
    return re.compile(r"\.".join(parts))


def base_prefix(model: nn.Module) -> str:
    """The path under which a key written for the base model also matches (its adapter's)."""
    return adapter_for(model).base_prefix(model)


def match_plan(model: nn.Module, plan: Mapping, *, strict: bool = False):
    """``(modules, params, unused)``: ``{module path: (key, style)}`` and ``{parameter name:
    (key, style)}`` for every match of every key, and the keys that matched nothing."""
    if not isinstance(plan, Mapping):
        raise PlanError(f"a plan must be a dict of module path -> style, got {type(plan).__name__}")
    module_names = [n for n, _ in model.named_modules()]
    param_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    prefix = base_prefix(model)
    modules: dict[str, tuple[str, object]] = {}
    params: dict[str, tuple[str, object]] = {}
    unused: list[str] = []
    for key, style in plan.items():
        if not isinstance(key, str) or not key:
            raise PlanError(f"plan keys must be module or parameter paths (non-empty strings), got {key!r}")
        normalize_style(style, key=key)  # an unknown style is an error even where nothing matches
        hits = _hits_under(key, prefix, module_names, param_names)
        if not any(hits):  # a parameter held quantized as `x_blocks` + `x_scales` (MXFP4): the key
            # names `x`, as transformers' quantizers extend plans (HfQuantizer.update_parallel_plan)
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
    """:func:`_hits` of ``key``, else of ``key`` under the base-model ``prefix``."""
    hits = _hits(key, module_names, param_names)
    return _hits(f"{prefix}.{key}", module_names, param_names) if not any(hits) and prefix else hits


def _hits(key: str, module_names, param_names) -> tuple[list[str], list[str]]:
    pattern = _key_pattern(key)
    dots = key.count(".")
    return tuple([n for n in names if n.count(".") == dots and pattern.fullmatch(n)]  # type: ignore[return-value]
                 for names in (module_names, param_names))


def _patterns(model: nn.Module) -> list[str]:
    """The model's module paths (and its parameters that are not a module's weight or bias,
    such as 3-D expert tensors) with each numeric component written ``*``, as plan keys are."""
    names = [n for n, _ in model.named_modules() if n]
    names += [n for n, _ in model.named_parameters() if n.rpartition(".")[2] not in ("weight", "bias")]
    return list(dict.fromkeys(re.sub(r"(?<![^.])\d+(?![^.])", "*", n) for n in names))


def closest_paths(key: str, patterns: list[str], prefix: str = "", n: int = 3) -> list[str]:
    """The ``n`` patterns most like ``key``; one under the base-model ``prefix`` is also
    compared without it, since a key may be written for the base model."""
    def score(pattern: str) -> float:
        bare = pattern[len(prefix) + 1:] if prefix and pattern.startswith(prefix + ".") else pattern
        return max(difflib.SequenceMatcher(None, key, p).ratio() for p in (pattern, bare))

    return sorted(patterns, key=lambda p: -score(p))[:n]


def check_some_key_matches(model: nn.Module, plan: Mapping, unused, *, what: str = "plan") -> None:
    """Raise ``PlanError`` when a non-empty ``plan`` has no key that matches anything: every key
    skipped would leave the whole model on every rank, which no one means (a plan written for
    another model, or for another module layout). Skipping stays per key when one matched."""
    if not plan or len(unused) < len(plan):
        return
    patterns, prefix = _patterns(model), base_prefix(model)
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


__all__ = ["base_prefix", "check_some_key_matches", "closest_paths", "match_plan"]
