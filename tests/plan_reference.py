"""Plan matching and head-count search as they were before STYLE.md rule 22 (a regex per key
over every name; every sharded path against every module): the reference the trie and the
parent walk are held to (tests/unit/test_plan_matching.py, tests/hf/test_plan_matching_hf.py)."""

import re

from shardwise.core.adapter import adapter_for
from shardwise.core.plan_rules import HEAD_ATTRS
from shardwise.core.quant_layout import MXFP4_SUFFIXES

_ATTENTION = re.compile(r"attn|attention|q_proj|k_proj|v_proj|qkv|to_q|to_k|to_v")


def regex_hits(key: str, names) -> list[str]:
    pattern = re.compile(r"\.".join(r"\d+" if p == "*" else re.escape(p) for p in key.split(".")))
    return [n for n in names if n.count(".") == key.count(".") and pattern.fullmatch(n)]


def _hits_under(key, prefix, module_names, param_names):
    for full in (key, f"{prefix}.{key}") if prefix else (key,):
        hits = (regex_hits(full, module_names), regex_hits(full, param_names))
        if any(hits):
            break
    return hits


def reference_match_plan(model, plan):
    module_names = [n for n, _ in model.named_modules()]
    param_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    prefix = adapter_for(model).base_prefix(model)
    modules, params, unused = {}, {}, []
    for key, style in plan.items():
        hits = _hits_under(key, prefix, module_names, param_names)
        if not any(hits):
            hits = ([], _hits_under(key + MXFP4_SUFFIXES[0], prefix, module_names, param_names)[1])
        if not any(hits):
            unused.append(key)
            continue
        for claimed, names in zip((modules, params), hits, strict=True):
            for name in names:
                claimed[name] = (key, style)
    return modules, params, unused


def reference_head_counts(model, sharded):
    if not sharded:
        return []
    config = getattr(model, "config", None)
    owners = [("config", config)] if config is not None else [("", model)]
    owners += [(n, m) for n, m in model.named_modules() if n]
    out = []
    for name, owner in owners:
        near = [p for p in sharded if name in ("", "config") or p.startswith(name + ".")]
        for attr in HEAD_ATTRS if near else ():
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                path = next((p for p in near if _ATTENTION.search(p)), near[0])
                out.append((f"model.{name}" if name else "model", attr, value, path))
    return out
