"""The rules :func:`~shardwise.core.plan.resolve_plan` holds a plan to, over plain data (pure):
split projections pair up (:func:`check_pairs`); every degree splits each tensor, packed block
and head count (:func:`check_degrees`)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

from torch import nn

from shardwise.core.spec import ShardSpec, block_sizes, check_shardable, dividing_degrees
from shardwise.core.styles import Style
from shardwise.core.walk import named_modules
from shardwise.errors import PlanError, ShardingError

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


def check_pairs(specs: Mapping[str, ShardSpec], shapes: Mapping[str, tuple[int, ...]],
                styles: Mapping[str, Style], keys: Mapping[str, str], degree: int) -> None:
    """``PlanError`` naming both modules where a split producer's sibling consumer does not
    split its input, or a consumer does while its producers are whole (``FAMILIES``)."""
    if degree == 1:
        return
    # {module path (or a parameter, as a 3-D expert weight): (its weight's spec, ndim)}
    matrices = {n.removesuffix(".weight"): (s, len(shapes[n]))
                for n, s in specs.items() if len(shapes[n]) >= 2}
    for producers, consumers in FAMILIES:
        for found in _siblings(matrices, producers, consumers).values():
            _check_family(found, matrices, styles, keys)


def _siblings(names: Collection[str], producers, consumers) -> dict[str, dict[str, list[str]]]:
    """``{parent: {"producers": [paths], "consumers": [paths]}}`` of the family in ``names``."""
    by_leaf: dict[str, list[tuple[str, str]]] = {}  # one dict lookup per tensor, not one per name
    for role, rels in (("producers", producers), ("consumers", consumers)):
        for rel in rels:
            by_leaf.setdefault(rel.rpartition(".")[2], []).append((role, rel))
    out: dict[str, dict[str, list[str]]] = {}
    for path in names:
        for role, rel in by_leaf.get(path.rpartition(".")[2], ()):
            if path == rel or path.endswith("." + rel):
                group = out.setdefault(path[: -len(rel)].rstrip("."), {"producers": [], "consumers": []})
                group[role].append(path)
    return out


def _splits(path: str, matrices, styles, role: str) -> bool:
    """Whether tp splits ``path``'s output features (producers: dim ``ndim - 2``, not gathered
    again) or its input features (consumers: the last dim, from an input arriving split)."""
    (spec, ndim), style = matrices[path], styles.get(path)
    if spec.replicated or spec.axis != "tp":
        return False
    if role == "producers":
        return spec.dim == ndim - 2 and not (style is not None and style.gather_output)
    return spec.dim == ndim - 1 and not (style is not None and style.split_input)


def _check_family(found: dict, matrices, styles, keys) -> None:
    producers, consumers = found["producers"], found["consumers"]
    split_out = [p for p in producers if _splits(p, matrices, styles, "producers")]
    split_in = [c for c in consumers if _splits(c, matrices, styles, "consumers")]
    if split_out and consumers and not split_in:
        p, c = split_out[0], consumers[0]
        key = _key(keys, p)
        raise PlanError(
            f"plan key {key!r} shards {p!r} colwise, so its output stays split over the ranks, but its "
            f"consumer {c!r} is {_what(c, matrices, styles)}: it would get part of its input features and "
            f"the forward would fail. Pair them: add {{{_sibling_key(key, p, c)!r}: 'rowwise'}} to the plan "
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


def _what(path: str, matrices, styles) -> str:
    style = styles.get(path)
    if style is not None and style.split_input:
        return f"{style.source!r}, which takes a whole input and splits it itself"
    spec = matrices[path][0]
    return "not in the plan" if spec.replicated else f"sharded as {spec}, not rowwise"


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
_HEAD_SET = frozenset(HEAD_ATTRS)
_ATTENTION = re.compile(r"attn|attention|q_proj|k_proj|v_proj|qkv|to_q|to_k|to_v")


def head_counts(model: nn.Module, sharded: list[str]) -> list[tuple[str, str, int, str]]:
    """``(owner, attribute, count, sharded path)`` of each head count on the config or on a
    module above a sharded projection."""
    if not sharded:
        return []
    config = getattr(model, "config", None)
    # the root's from its config: diffusers warns on config attributes read off the model
    owners = [("config", config)] if config is not None else [("", model)]
    # {module path: the sharded paths below it, in their order}: one pass over each path's
    # parents, not every module against every sharded path (a 64-layer model: 0.07 s -> 1 ms)
    below: dict[str, list[str]] = {}
    for p in sharded:
        i = p.find(".")
        while i != -1:
            below.setdefault(p[:i], []).append(p)
            i = p.find(".", i + 1)
    owners += [(n, m) for n, m in named_modules(model) if n in below or n == "config"]
    out = []
    for name, owner in owners:
        near = sharded if name in ("", "config") else below[name]
        for attr in _head_attrs(owner):
            try:
                value = getattr(owner, attr, None)
            except Exception:  # noqa: BLE001 - a per-layer config attribute refuses a global read
                continue
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                path = next((p for p in near if _ATTENTION.search(p)), near[0])
                out.append((f"model.{name}" if name else "model", attr, value, path))
    return out


def _head_attrs(owner) -> tuple[str, ...]:
    """The names of ``HEAD_ATTRS`` worth asking ``owner``: for a module whose class keeps
    nn.Module's ``__getattr__`` (an int is never a parameter, buffer or submodule), those in its
    instance dict or on its class, found by a set intersection, not seven misses per module (the
    64x32 MoE asks ~8,000 modules); every name for anything else."""
    cls: Any = type(owner)  # hashable (mypy reads nn.Module's __hash__ off the class)
    if not isinstance(owner, nn.Module) or cls.__getattr__ is not nn.Module.__getattr__:
        return HEAD_ATTRS
    found = _HEAD_SET.intersection(owner.__dict__)
    return _class_head_attrs(cls) if not found else tuple(
        a for a in HEAD_ATTRS if a in found or a in _class_head_attrs(cls))


@functools.lru_cache(maxsize=1024)
def _class_head_attrs(cls: type) -> tuple[str, ...]:
    return tuple(a for a in HEAD_ATTRS if hasattr(cls, a))


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


__all__ = ["FAMILIES", "HEAD_ATTRS", "check_degrees", "check_pairs", "head_counts"]
