"""A split projection and the projection that consumes it must be planned as a pair.

A colwise projection leaves its output split over the ranks; the projection that reads that
output must be rowwise (it takes exactly that split input and ends with one all-reduce).
Without it the forward fails inside torch (``mat1 and mat2 shapes cannot be multiplied``),
and a rowwise projection whose producers are all whole fails the same way. The pairs are
found by name among the siblings of one module, in the naming families transformers and
diffusers use (``q_proj``/``k_proj``/``v_proj`` -> ``o_proj``, ``to_q`` -> ``to_out.0``,
``gate_proj``/``up_proj`` -> ``down_proj``, ``fc1`` -> ``fc2``, ...): a module outside these
families is not checked, so a plan is refused only where the pairing is certain. Pure: names
and specs only (no module is inspected, no process group).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from shardwise.core.spec import ShardSpec
from shardwise.core.styles import Style
from shardwise.errors import PlanError

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


__all__ = ["FAMILIES", "check_pairs"]
