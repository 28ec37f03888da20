"""Degree checks of a plan: the degree of each mesh axis must split every tensor sharded over
it, every packed block on its own, and (tp) every attention head count next to a sharded
projection, so that each rank owns whole heads. A refusal lists the degrees that pass every
check of the plan, head counts included, so that the degree it suggests does not fail next.
Pure: no torch.distributed, no file I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn

from shardwise.core.spec import block_sizes, check_shardable, dividing_degrees
from shardwise.errors import PlanError, ShardingError

_HEAD_ATTRS = ("num_heads", "heads", "num_attention_heads", "num_key_value_heads",
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
        for attr in _HEAD_ATTRS:
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


__all__ = ["check_degrees", "head_counts"]
