"""Model adapters: what a model library decides that no checkpoint says (names, plans, side
files, layouts). A model gets the first registered adapter that claims it, else the plain
:class:`ModelAdapter`; ``refuse`` is asked of every adapter."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from torch import nn

from shardwise.errors import UsageError

if TYPE_CHECKING:
    from shardwise.core.header import NamedDtype
    from shardwise.core.pieces import Composite, StoredPart
    from shardwise.io.storage import Location

T = TypeVar("T")
# {model tensor or stored key: (global shape, safetensors dtype)}
Shapes = Mapping[str, tuple[tuple[int, ...], str]]


class ModelAdapter:
    """The answers for a plain torch model; a library's adapter overrides what it knows.

    >>> adapter_for(nn.Linear(2, 2)).name
    'torch'
    """

    name = "torch"
    side_files: tuple[str, ...] = ()  # files beside the weights that a consolidation copies

    def claims(self, model: nn.Module) -> bool:
        """Whether this adapter speaks for ``model`` (its class hierarchy, no import)."""
        return False

    def base_prefix(self, model: nn.Module) -> str:
        """The path under which a plan key written for the base model also matches ("")."""
        return ""

    def shipped_plan(self, model: nn.Module, axis: str) -> dict:
        """The plan ``model`` ships for ``axis`` ("tp" or "ep"); ``{}`` when none."""
        return {}

    def refuse(self, model: nn.Module, action: str) -> None:
        """``UnsupportedModelError`` for what shardwise cannot ``action`` ("load", ...) on ``model``."""

    def stored_tensors(self, model: nn.Module, stored: Mapping[str, tuple[Location | None, NamedDtype]],
                       wanted: set[str], shapes: Mapping[str, tuple[int, ...]] | None = None,
                       ) -> tuple[dict[str, Composite], set[str]]:
        """``({model tensor: Composite}, stored keys used)`` for the ``wanted`` tensors that
        ``stored`` ({key: (file or None, entry)}) holds under other keys or in pieces."""
        return {}, set()

    def save_layout(self, model: nn.Module, tensors: Shapes) -> list[StoredPart] | None:
        """The ``StoredPart`` s a save writes for ``tensors``, in order; None: the model's names."""
        return None

    def unsaved(self, model: nn.Module) -> frozenset[str]:
        """Model tensors that a save in the library's layout leaves out."""
        return frozenset()

    def stored_names(self, model: nn.Module, tensors: Shapes) -> dict[str, tuple[tuple[int, ...], str]]:
        """``tensors`` under the keys the library writes (names and shapes only)."""
        return dict(tensors)

    def shared_storages(self, parts: list[StoredPart], itemsize: Mapping[str, int]) -> dict:
        """``{stored key: (storage id, bytes)}`` of parts the library saves as views of one storage."""
        return {}

    def file_prefix(self, model: nn.Module) -> str:
        """The weight file prefix the model's library reads."""
        return "model"

    def index_metadata(self, model: nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> dict:
        """The index's ``metadata`` besides ``total_size``: ``total_parameters`` (tied ones once)."""
        params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        return {"total_parameters": sum(math.prod(s) for n, s in shapes.items() if n in params)}

    def write_side_files(self, model: nn.Module, folder: Location) -> list[str]:
        """Write the files the library reads beside the weights into ``folder``; their names."""
        return []

    def model_from_folder(self, folder: Location, *, need: bool = False) -> nn.Module | None:
        """The meta-device model a folder's side files name, or None (``need``: ``CheckpointError``)."""
        return None

    def quantization_config(self, folder: Location) -> tuple[object, Location] | None:
        """``(quantization_config or None, the side file)``; None without such a file."""
        return None

    def model_from_config(self, path: Path) -> nn.Module | None:
        """The meta-device model of the config file ``path``, or of this library's config in the
        folder ``path``; None without one or if not this library's, else ``CheckpointError``."""
        return None

    def save_collection(self, obj: object, path, options: dict) -> bool:
        """Save ``obj``, a collection of models that is not one module (a diffusers pipeline),
        to ``path`` with ``sw.save``'s ``options``; False when ``obj`` is not this library's.
        Collective, like ``sw.save``."""
        return False


_PLAIN = ModelAdapter()
_ADAPTERS: dict[str, ModelAdapter] = {}
# The adapters shardwise ships, registered on first use of the registry (importing shardwise
# stays light): Hugging Face's (transformers, diffusers; needs neither library to import) and
# diffusers pipelines' (sw.save of a pipeline).
_BUILTIN = ("shardwise.hf.adapter", "shardwise.hf.pipeline")
_builtin_loaded = False


def _registered() -> dict[str, ModelAdapter]:
    global _builtin_loaded
    if not _builtin_loaded:
        _builtin_loaded = True
        for module in _BUILTIN:
            importlib.import_module(module)  # registers itself
    return _ADAPTERS


def register_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """Make ``adapter`` answer for the models it claims; ``UsageError`` for a taken name."""
    if not isinstance(adapter, ModelAdapter) or adapter.name == _PLAIN.name:
        raise UsageError(f"a model adapter subclasses core.adapter.ModelAdapter and has a name of its own, "
                         f"got {adapter!r}")
    registered = _registered()  # the built-in adapters first, as before
    if adapter.name in registered and registered[adapter.name] is not adapter:
        raise UsageError(f"a model adapter named {adapter.name!r} is already registered; registered: "
                         f"{', '.join(_ADAPTERS)}")
    _ADAPTERS[adapter.name] = adapter
    return adapter


def adapters() -> tuple[ModelAdapter, ...]:
    """Every registered adapter, in registration order."""
    return tuple(_registered().values())


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The registered adapter that claims ``model``, else the plain torch one."""
    return next((a for a in _registered().values() if a.claims(model)), _PLAIN)


def refuse_unsupported(model: nn.Module, action: str) -> None:
    """Every registered adapter's :meth:`ModelAdapter.refuse` on ``model``."""
    for adapter in _registered().values():
        adapter.refuse(model, action)


def _first(answer: Callable[[ModelAdapter], T | None]) -> T | None:
    """The first registered adapter's ``answer(adapter)`` that is not None, else None."""
    return next((found for a in _registered().values() if (found := answer(a)) is not None), None)


def folder_model(folder: Location, *, need: bool = False) -> nn.Module | None:
    """The first adapter's ``model_from_folder``, or None."""
    return _first(lambda a: a.model_from_folder(folder, need=need))


def folder_quantization(folder: Location) -> tuple[object, Location] | None:
    """The first adapter's ``quantization_config`` of ``folder``, or None."""
    return _first(lambda a: a.quantization_config(folder))


def config_model(path: Path) -> nn.Module | None:
    """The first adapter's ``model_from_config`` (a config file, or a folder holding one), or None."""
    return _first(lambda a: a.model_from_config(Path(path)))


def save_collection(obj: object, path, options: dict) -> bool:
    """Whether an adapter saved ``obj`` (not a module: a pipeline of models) as a collection."""
    return _first(lambda a: a.save_collection(obj, path, options) or None) is not None


def side_file_names() -> tuple[str, ...]:
    """The side files of every registered adapter, each once."""
    return tuple(dict.fromkeys(n for a in _registered().values() for n in a.side_files))


__all__ = ["ModelAdapter", "adapter_for", "adapters", "config_model", "folder_model", "folder_quantization",
           "refuse_unsupported", "register_adapter", "save_collection", "side_file_names"]
