"""One walk of a model per verb. A load asks a model for its modules and tensors from many places
(the guards, the adapter's refusals, plan matching, head counts, the quantization ties, the
source's key match, install, wire, the checks after): each ``named_modules`` is a recursive
generator over every module, and each ``state_dict`` another recursion. Inside
:func:`one_walk` the first question walks the model and the others reuse the answer.

The modules of a model do not change during a verb (its tensors do: install replaces them), so
the module table lives for the whole block; the tensor table is dropped by
:func:`tensors_changed`, which whoever replaces tensors calls. Outside the block, or for
another model, every call walks as torch does.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn


class _Walk:
    __slots__ = ("model", "all_modules", "modules", "tensors")

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.all_modules: dict[str, nn.Module] | None = None
        self.modules: list[tuple[str, nn.Module]] | None = None
        self.tensors: dict[str, torch.Tensor] | None = None


_ACTIVE: ContextVar[_Walk | None] = ContextVar("shardwise_walk", default=None)


@contextmanager
def one_walk(model: nn.Module) -> Iterator[None]:
    """Within the block, :func:`module_table`, :func:`named_modules` and :func:`state_tensors`
    of ``model`` walk it once each; the block must not add or remove modules.

    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> with one_walk(m):
    ...     module_table(m) is module_table(m)
    True
    """
    token = _ACTIVE.set(_Walk(model))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _walk_of(model: nn.Module) -> _Walk | None:
    walk = _ACTIVE.get()
    return walk if walk is not None and walk.model is model else None


def module_table(model: nn.Module) -> dict[str, nn.Module]:
    """``dict(model.named_modules(remove_duplicate=False))``: every path, a shared module under
    each of its paths. Do not mutate it.

    >>> list(module_table(torch.nn.Sequential(torch.nn.Linear(2, 2))))
    ['', '0']
    """
    walk = _walk_of(model)
    if walk is None:
        return dict(model.named_modules(remove_duplicate=False))
    if walk.all_modules is None:
        walk.all_modules = dict(model.named_modules(remove_duplicate=False))
    return walk.all_modules


def named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``list(model.named_modules())``: each module once, at its first path."""
    walk = _walk_of(model)
    if walk is None:
        return list(model.named_modules())
    if walk.modules is None:
        seen: set[int] = set()
        walk.modules = [(p, m) for p, m in module_table(model).items()
                        if id(m) not in seen and not seen.add(id(m))]  # type: ignore[func-returns-value]
    return walk.modules


def named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``dict(model.named_parameters(remove_duplicate=False))``, from the module table."""
    return {f"{path}.{n}" if path else n: p for path, m in module_table(model).items()
            for n, p in m._parameters.items() if p is not None}


def state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict(keep_vars=True)``, as of the last :func:`tensors_changed`. Do not
    mutate it."""
    walk = _walk_of(model)
    if walk is None:
        return model.state_dict(keep_vars=True)
    if walk.tensors is None:
        walk.tensors = model.state_dict(keep_vars=True)
    return walk.tensors


def tensors_changed(model: nn.Module) -> None:
    """``model``'s tensors were replaced: the next :func:`state_tensors` walks again."""
    walk = _walk_of(model)
    if walk is not None:
        walk.tensors = None


_MISSING = object()
_PLAIN_GETATTR = nn.Module.__getattr__


def attribute(module: nn.Module, name: str, default: object = None) -> object:
    """``getattr(module, name, default)``, but a miss costs a few dict lookups, not
    ``nn.Module.__getattr__``'s raise: the guards ask every module of a model for attributes
    that libraries attach to a few (accelerate's ``_hf_hook``, PEFT's ``lora_A``...). Exact for
    any module whose class keeps nn.Module's ``__getattr__`` (others are asked as they are).

    >>> linear = torch.nn.Linear(2, 2)
    >>> attribute(linear, "_hf_hook") is None, attribute(linear, "in_features"), attribute(linear, "x", 0)
    (True, 2, 0)
    """
    cls: Any = type(module)  # hashable (mypy reads nn.Module's __hash__ off the class)
    if (cls.__getattr__ is _PLAIN_GETATTR and name not in module.__dict__ and not _on_class(cls, name)
            and name not in module._parameters and name not in module._buffers
            and name not in module._modules):
        return default
    return getattr(module, name, default)


@functools.lru_cache(maxsize=4096)
def _on_class(cls: type, name: str) -> bool:
    return hasattr(cls, name)


def has_attribute(module: nn.Module, name: str) -> bool:
    """``hasattr(module, name)``, as :func:`attribute` asks."""
    return attribute(module, name, _MISSING) is not _MISSING


__all__ = ["attribute", "has_attribute", "module_table", "named_modules", "named_parameters", "one_walk",
           "state_tensors", "tensors_changed"]
