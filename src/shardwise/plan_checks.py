"""Checks around a parallelize or load that need more than core: :func:`check_plan` and
:func:`check_unused_keys` before, :func:`check_installed` after."""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
import warnings

import torch
from torch import nn

from shardwise import comm
from shardwise.core.adapter import adapter_for
from shardwise.core.plan import ResolvedPlan
from shardwise.core.plan_rules import HEAD_ATTRS
from shardwise.core.quant_layout import scale_local_shape
from shardwise.core.spec import local_shape
from shardwise.core.styles import _patterns, closest_paths
from shardwise.errors import PlanError, ShardingError
from shardwise.holding import Holding, is_dtensor, local_of

_HEAD_ATTRS = frozenset((*HEAD_ATTRS, "n_head"))  # plus n_head, GPT-2 config's name
_SHAPING = frozenset(("view", "reshape", "unflatten", "rearrange"))


def check_plan(model: nn.Module, specs: ResolvedPlan) -> None:
    """``PlanError`` where a module with a colwise-split projection shapes activations with its
    global head count (``q.view(b, t, self.num_heads, -1)``); before any byte is read."""
    if specs.degree == 1:
        return
    owners: dict[str, str] = {}  # owning module -> the first split projection under it
    for path, style in specs.styles.items():
        splits_heads = style.kind == "colwise" and not (style.gather_output or style.embedding)
        if splits_heads and style.axis == "tp":
            owners.setdefault(path.rpartition(".")[0], path)
    for owner, projection in owners.items():
        if getattr(specs.styles.get(owner), "forward", None) == "local_heads":
            continue  # its head counts become the local ones when it is wired
        module = model.get_submodule(owner)
        for func in _code_of(module):
            uses = _scan(func)[1]
            if uses:
                name = getattr(func, "__qualname__", repr(func))
                raise PlanError(
                    f"plan key {specs.keys[projection]!r} shards {projection!r} colwise, so each rank "
                    f"holds 1/{specs.degree} of the heads of {owner or 'the model'!r}, but {name} shapes "
                    f"them with the global head count ({uses[0]}): the forward would fail or be wrong "
                    "without an error. "
                    "Infer the local count from the tensor instead (view(b, t, -1, head_dim)), or keep this "
                    "module's projections whole (drop their keys)")


def _code_of(module: nn.Module) -> list:
    """The module's ``forward``, its processor's ``__call__`` (diffusers), and its methods they call."""
    funcs = [type(module).forward]
    processor = getattr(module, "processor", None)
    if processor is not None and callable(processor):
        funcs.append(type(processor).__call__)
    for func in list(funcs):
        for name in _scan(func)[0]:
            method = getattr(type(module), name, None)
            if inspect.isfunction(method) and method not in funcs:
                funcs.append(method)
    return funcs


@functools.cache  # one parse per function, not per layer
def _scan(func) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(methods func calls on the module, its shaping calls whose arguments read a head count
    off the module, directly or through a local name: heads = attn.heads)``; the module is held
    by ``self`` or, in a diffusers processor's ``__call__(self, attn, ...)``, by ``attn`` too."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError):  # no source (built in, compiled): nothing to check
        return (), ()
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return (), ()
    args = [a.arg for a in node.args.args]
    holders = frozenset(args[:2] if len(args) > 1 and args[0] == "self" and func.__name__ == "__call__"
                        else args[:1])
    calls = [c for c in ast.walk(node) if isinstance(c, ast.Call)]
    called = tuple(dict.fromkeys(c.func.attr for c in calls if isinstance(c.func, ast.Attribute)
                                 and isinstance(c.func.value, ast.Name) and c.func.value.id in holders))
    aliases = {t.id for a in ast.walk(node) if isinstance(a, ast.Assign) and _reads_heads(a.value, holders)
               for t in a.targets if isinstance(t, ast.Name)}
    uses = tuple(ast.unparse(c) for c in calls if _callee(c) in _SHAPING and any(
        _reads_heads(sub, holders) or (isinstance(sub, ast.Name) and sub.id in aliases)
        for arg in [*c.args, *(k.value for k in c.keywords)] for sub in ast.walk(arg)))
    return called, uses


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _reads_heads(node: ast.AST, holders: frozenset[str]) -> bool:
    """Whether ``node`` reads a head count off the module or its config (``attn.heads``)."""
    if not (isinstance(node, ast.Attribute) and node.attr in _HEAD_ATTRS):
        return False
    base = node.value
    while isinstance(base, ast.Attribute):
        base = base.value
    return isinstance(base, ast.Name) and base.id in holders


def check_installed(model: nn.Module, specs: ResolvedPlan, declared: dict, *, holding: Holding,
                    dtype: torch.dtype | None, coords: dict | None = None) -> None:
    """``ShardingError`` naming the tensor unless each tensor of ``model`` has its ``declared``
    global shape and its spec's local shape (scales: their tie's, at ``coords``), floating ones
    are ``dtype`` (quantized ones and others keep theirs) and ties still share one tensor."""
    state = model.state_dict(keep_vars=True)
    for name, spec in specs.items():
        shape, declared_dtype = declared[name]
        t = state[name]
        held_dtensor = is_dtensor(t)
        # the DTensor's own local tensor: to_local() runs an autograd Function per tensor
        own = getattr(t, "_local_tensor", None) if held_dtensor else t
        local = tuple((own if own is not None else local_of(t)).shape)
        if holding.one_process:  # a global tensor, placed over the devices
            local, want_local = tuple(t.shape), shape
        elif name in specs.ties and coords is not None:  # an FP8 weight's scales, split along
            want_local = scale_local_shape(specs.ties[name], spec, *coords[spec.axis])
        else:
            want_local = local_shape(shape, spec, specs.degrees[spec.axis])
        if (held_dtensor and tuple(t.shape) != shape) or local != want_local:
            held = f"a DTensor of global shape {tuple(t.shape)}" if held_dtensor else "a tensor"
            raise ShardingError(
                f"{name!r}: after sharding it is {held} with local shape {local}, but the model "
                f"declares {shape} sharded as {spec} (local {want_local}); this is a shardwise bug, "
                "please report it with the plan")
        cast = dtype if name not in specs.quantized else None
        if declared_dtype.is_floating_point != t.dtype.is_floating_point or (
                not t.dtype.is_floating_point and t.dtype != declared_dtype) or (
                name in specs.quantized and t.dtype != declared_dtype) or (
                cast is not None and t.dtype.is_floating_point and t.dtype != cast):
            want = cast if cast is not None and declared_dtype.is_floating_point else declared_dtype
            raise ShardingError(f"{name!r} is {t.dtype} after sharding but must be {want}")
    for alias, kept in specs.aliases.items():
        if state.get(alias) is not state.get(kept):
            raise ShardingError(f"{alias!r} and {kept!r} are tied in the model but no longer share one "
                                "tensor after sharding; this is a shardwise bug, please report it")


def check_unused_keys(model: nn.Module, unused: tuple[str, ...], *, ours: bool) -> None:
    """Plan keys that match nothing in ``model``. A key one or two letters away from a path of
    the model in one of its parts (``layers.*.mlp.upp_proj`` for ``up_proj``) is a typo: a
    ``PlanError`` naming the key and the path, at every degree (tp=1 too, so that a plan tried
    at tp=1 is right at tp=8), where ``ours`` (the caller's plan, not ``"auto"``) and the key is
    not one of the plans the model ships (those name modules of every variant: ``q_b_proj``
    where a configuration has only ``q_a_proj``). Any other key is warned about once, on rank
    0, with the closest paths."""
    if not unused:
        return
    patterns = _patterns(model)
    adapter = adapter_for(model)
    shipped = [k for axis in ("tp", "ep") for k in adapter.shipped_plan(model, axis)]
    params = {re.sub(r"(?<![^.])\d+(?![^.])", "*", n) for n, _ in model.named_parameters()}
    for key in unused if ours else ():
        if any(k == key or k.endswith("." + key) for k in shipped):
            continue
        near = [m for m in (_one_part_off(key, p) for p in [*patterns, *sorted(params)]) if m]
        if near:
            raise PlanError(f"plan key {key!r} matches nothing in {type(model).__name__}; did you mean "
                            f"{near[0]!r}? A key that matches nothing is skipped, so the module it meant "
                            "would stay whole on every rank, and at tp > 1 the forward would fail or be "
                            "wrong. Fix the key (refused at tp=1 too), or remove it")
    if comm.rank() == 0:
        shown = "; ".join(f"{k!r} (closest: {', '.join(map(repr, closest_paths(k, patterns, n=2)))})"
                          for k in unused[:5])
        more = f"; and {len(unused) - 5} more" if len(unused) > 5 else ""
        warnings.warn(f"{len(unused)} plan key(s) match nothing in {type(model).__name__} and were "
                      f"skipped (they shard nothing): {shown}{more}", stacklevel=3)


def _one_part_off(key: str, pattern: str) -> str | None:
    """``key`` with its one dotted part that is at most two edits from ``pattern``'s (or its
    tail's) put right, None where they differ otherwise."""
    have, want = key.split("."), pattern.split(".")
    if len(want) < len(have):
        return None
    want = want[len(want) - len(have):]
    off = [i for i, (a, b) in enumerate(zip(have, want, strict=True))
           if a != b and not (b == "*" and a.isdigit())]
    if len(off) != 1:
        return None
    a, b = have[off[0]], want[off[0]]
    if min(len(a), len(b)) <= 3 or _edits(a, b) > 2:
        return None
    return ".".join(want[i] if i == off[0] else part for i, part in enumerate(have))


def _edits(a: str, b: str) -> int:
    """The Levenshtein distance of ``a`` and ``b`` (short path parts)."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


__all__ = ["check_installed", "check_plan", "check_unused_keys"]
