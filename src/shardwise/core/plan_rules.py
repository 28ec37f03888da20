"""The rules a plan is held to, all pure (names, shapes and specs; no process group):

- key matching (as transformers matches keys): each ``*`` is one numeric path component, a
  key names a module or a parameter, a key written for the base model also matches under its
  adapter's ``base_prefix``; keys that match nothing are returned, not raised (unless
  ``strict``), but a plan none of whose keys matches is refused;
- pairing: a colwise projection's sibling consumer must be rowwise (and the reverse), found
  by name in the naming families of ``FAMILIES``; a module outside them is not checked;
- degrees: each axis's degree splits every tensor sharded over it, each packed block on its
  own, and (tp) every head count next to a sharded projection; a refusal lists the degrees
  that pass every check.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Collection, Mapping

from torch import nn

from shardwise.core.adapter import adapter_for
from shardwise.core.quant_layout import MXFP4_SUFFIXES
from shardwise.core.spec import ShardSpec, block_sizes, check_shardable, dividing_degrees
from shardwise.core.styles import Style, normalize_style
from shardwise.errors import PlanError, ShardingError

# -- key matching ---------------------------------------------------------------------------

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


# -- pairing of split projections ----------------------------------------------------------

# (producers, consumers): paths relative to one module. Producers split their output
# (colwise), consumers their input (rowwise). A name may sit in two families (c_proj is
# GPT-2's attention and MLP output): only siblings are ever paired.
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
    """The spec of the module's weight, or of ``path`` itself when it names a parameter;
    ``None`` when there is no such tensor."""
    for name in (f"{path}.weight", path):
        if name in specs:
            return specs[name]
    return None


def _splits(path: str, specs, shapes, styles, role: str) -> bool:
    """Whether the tp plan splits ``path``'s output features (producers: dim ``ndim - 2``, as
    colwise does, and not gathered again) or its input features (consumers: the last dim, as
    rowwise does, from an input that arrives split)."""
    spec, ndim = _weight_spec(specs, path), len(_shape(shapes, path))
    if spec is None or spec.replicated or spec.axis != "tp" or ndim < 2:
        return False
    style = styles.get(path)
    if role == "producers":
        return spec.dim == ndim - 2 and not (style is not None and style.gather_output)
    return spec.dim == ndim - 1 and not (style is not None and style.split_input)


def check_pairs(specs: Mapping[str, ShardSpec], shapes: Mapping[str, tuple[int, ...]],
                styles: Mapping[str, Style], keys: Mapping[str, str], degree: int) -> None:
    """Raise ``PlanError`` naming both modules when a split producer's sibling consumer does
    not split its input, or a consumer splits its input while its sibling producers are all
    whole. ``specs``/``shapes``: ``{tensor name: ...}`` of the 2-D weights (and parameters);
    ``keys``: which plan key claimed each module or parameter. Degree 1 splits nothing."""
    if degree == 1:
        return
    for producers, consumers in FAMILIES:
        for parent, found in _siblings(specs, producers, consumers).items():
            _check_family(parent, found, specs, shapes, styles, keys)


def _siblings(names: Collection[str], producers, consumers) -> dict[str, dict[str, list[str]]]:
    """``{parent: {"producers": [...], "consumers": [...]}}`` for every module with a member
    of the family, each listed by full path (its weight, or itself, in ``names``)."""
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
    """The plan key for ``sibling`` written like ``key`` (its '*'s and prefix kept): the
    components after their common parent replaced."""
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
    """``(owner, attribute, count, sharded path)`` for every head count on the model's config,
    or on a module above a sharded projection (the path shown is an attention one if any)."""
    if not sharded:
        return []
    config = getattr(model, "config", None)
    # The root's head counts come from its config: diffusers warns on config attributes
    # read off the model itself.
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


def _heads_error(counts, keys: dict, degree: int) -> str | None:
    for where, attr, value, path in counts:
        if degree > 1 and value % degree:
            return (f"{where}.{attr} = {value} is not divisible by degree {degree}, but plan key "
                    f"{keys[path]!r} shards {path!r}: each rank must own whole heads")
    return None


def check_degrees(tensors: list, counts: list, keys: dict, degrees: dict[str, int],
                  others: Callable[[dict[str, int]], None]) -> None:
    """Raise ``ShardingError`` unless each axis's degree splits its sharded ``tensors``
    (``(shape, spec, name, key)``) and, for tp, the head ``counts`` (:func:`head_counts`).
    The error lists the degrees that pass every check: these, and ``others(degrees)``, the
    plan's remaining degree-dependent checks (raising ``PlanError`` when they fail)."""
    for axis in ("tp", "ep"):
        error = _error_at(tensors, counts, keys, axis, degrees[axis])
        if error is not None:
            ok = _passing(tensors, counts, keys, degrees, axis, others)
            # from None: this message says all the cause did, and the cause's own hint (the
            # divisors of one dim) would contradict the list of degrees that pass every check
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
            # Not the spec's own hint (the divisors of this one dim): the list of degrees
            # that pass every check follows.
            sizes = block_sizes(shape, spec)
            blocks = f" (packed blocks of sizes {list(sizes)})" if spec.packed else ""
            return (f"plan key {key!r}, tensor {name!r} of shape {shape}: dim {spec.dim} of size "
                    f"{shape[spec.dim]}{blocks} cannot be split over degree {degree}")
    return _heads_error(counts, keys, degree) if axis == "tp" else None


__all__ = ["FAMILIES", "HEAD_ATTRS", "base_prefix", "check_degrees", "check_pairs",
           "check_some_key_matches", "closest_paths", "head_counts", "match_plan"]
