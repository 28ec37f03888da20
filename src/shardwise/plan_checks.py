"""Checks around a parallelize or load that need more than core: :func:`check_plan` before,
:func:`check_installed` after."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch
from torch import nn

from shardwise.core.plan import ResolvedPlan
from shardwise.core.plan_rules import HEAD_ATTRS
from shardwise.core.quant_layout import scale_local_shape
from shardwise.core.spec import local_shape
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


__all__ = ["check_installed", "check_plan"]
