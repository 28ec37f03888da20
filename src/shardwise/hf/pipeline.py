"""A whole diffusers pipeline on one mesh: ``sw.from_pretrained(Flux2Pipeline, "pipe/", mesh=mesh)``
and ``sw.save(pipe, "out/")``.

Every model component with a TP plan (diffusers' ``_tp_plan``, transformers' ``base_model_tp_plan``)
streams sharded through ``sw.from_pretrained``; the other models load whole on each rank's device
with their library's ``from_pretrained``; schedulers, tokenizers and processors load as diffusers
loads them. Every component is checked (its folder, its class, its plan at the mesh's degree)
before any weight is read. Imported on first use, from ``hf.pretrained`` and ``io.save``.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.comm import agree
from shardwise.comm import rank as this_rank
from shardwise.core.adapter import ModelAdapter, register_adapter
from shardwise.core.plan import resolve_plan
from shardwise.errors import CheckpointError, ShardingError, UnsupportedModelError, UsageError
from shardwise.hf.adapter import HuggingFace, _meta_model, config_folder
from shardwise.hf.hub_layout import library_of
from shardwise.io.save import save
from shardwise.io.sink import Saving
from shardwise.io.storage import Location, locate, read_json, target_path, write_small
from shardwise.io.storage.lookups import DONE_MARK
from shardwise.mesh import decode_mesh, world_backend

_INDEX = "model_index.json"
_PLAIN_CAP = 1 << 30  # a tokenizer's files: tens of MB


def is_pipeline(cls_or_obj: Any) -> bool:
    """Whether ``cls_or_obj`` (a class or an instance) is a diffusers ``DiffusionPipeline``;
    diffusers is not imported."""
    cls = cls_or_obj if isinstance(cls_or_obj, type) else type(cls_or_obj)
    return any((c.__module__.split(".")[0], c.__name__) == ("diffusers", "DiffusionPipeline")
               for c in cls.__mro__)


@dataclass(frozen=True)
class Component:
    """One entry of ``model_index.json`` as this load treats it: ``how`` is ``"shard"`` (a model
    streamed with its TP plan), ``"whole"`` (a model loaded whole on each rank) or ``"plain"``
    (a scheduler, tokenizer or processor)."""

    name: str
    cls: type
    how: str
    folder: Location
    dtype: torch.dtype | None


def _component_class(name: str, entry: Any, index: Location) -> type | None:
    """The class ``model_index.json`` names for component ``name``; None for a component saved
    as absent (``[null, null]``); ``UnsupportedModelError`` for one diffusers cannot build."""
    if not (isinstance(entry, list) and len(entry) == 2):
        raise CheckpointError(f"{index}: the entry of {name!r} is {entry!r}, not [library, class name]")
    library, class_name = entry
    if library is None or class_name is None:
        return None
    try:
        module = importlib.import_module(library)
    except ImportError as e:
        raise UnsupportedModelError(
            f"{index}: component {name!r} is a {library}.{class_name}, and {library!r} cannot be "
            f"imported ({e}); install it, or pass the component built yourself: {name}=...") from e
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not hasattr(cls, "from_pretrained"):
        raise UnsupportedModelError(
            f"{index}: component {name!r} names {library}.{class_name}, which diffusers cannot build "
            f"(no such class with from_pretrained in {library} {getattr(module, '__version__', '')}); "
            f"upgrade {library}, or pass the component built yourself: {name}=...")
    return cls


def _dtype_of(dtype: torch.dtype | Mapping[str, torch.dtype] | None, name: str) -> torch.dtype | None:
    if isinstance(dtype, Mapping):  # as diffusers' torch_dtype: per component, "default" for the rest
        return dtype.get(name, dtype.get("default"))
    return dtype


def _check_dtype(dtype, names: Iterable[str]) -> None:
    values = dict(dtype) if isinstance(dtype, Mapping) else {"dtype": dtype}
    for key, value in values.items():
        if value is not None and not isinstance(value, torch.dtype):
            raise TypeError(f"dtype[{key!r}] must be a torch.dtype or None, got {value!r}")
    unknown = sorted(set(values) - {"dtype", "default", *names}) if isinstance(dtype, Mapping) else []
    if unknown:
        raise UsageError(f"dtype names {unknown}, not components of this pipeline ({sorted(names)}); "
                         "give a dtype per component name, or 'default' for the rest")


def _classify(name: str, cls: type, folder: Location, degree: int, shard: Iterable[str] | None,
              dtype: torch.dtype | None) -> Component:
    """The :class:`Component` for ``name``; a model's meta build resolves its plan at ``degree``."""
    if library_of(cls) is None:
        if shard is not None and name in shard:
            raise UsageError(f"shard= names {name!r}, a {cls.__name__}, which is not a model (nothing to "
                             "shard); name model components only")
        return Component(name, cls, "plain", folder, dtype)
    if (folder / "config.json").stat() is None:
        raise CheckpointError(f"{folder}: no config.json for the component {name!r} "
                              f"({cls.__name__}); the pipeline folder is incomplete")
    with config_folder(folder) as local:  # the libraries read local configs only
        model = _meta_model(cls, local, folder / "config.json")
    has_plan = bool(HuggingFace().shipped_plan(model, "tp"))
    if shard is not None and name in shard and not has_plan:
        raise UsageError(f"shard= names {name!r}, but {cls.__name__} has no TP plan (no _tp_plan, no "
                         "base_model_tp_plan); drop it from shard=, or load it yourself with "
                         f"sw.from_pretrained(..., plan={{...}}) and pass {name}=...")
    if not has_plan or (shard is not None and name not in shard):
        return Component(name, cls, "whole", folder, dtype)
    try:
        resolve_plan(model, "auto", degree)
    except ShardingError as e:  # its message lists the degrees that fit
        raise ShardingError(f"component {name!r} ({cls.__name__}) cannot be split {degree} ways: {e}; "
                            f"or load {name!r} whole on every rank: shard=[...] without it") from e
    return Component(name, cls, "shard", folder, dtype)


def plan_components(cls: type, folder: Location, *, degree: int, given: Mapping[str, Any],
                    shard: Iterable[str] | None, dtype) -> tuple[list[Component], dict[str, Any]]:
    """What ``from_pretrained`` will do with each component of ``folder``, every check done: the
    index, each component's folder and class, each sharded plan at ``degree``; and the pipeline's
    own settings the index holds (Wan's ``boundary_ratio``: the init's arguments that are not
    components, as diffusers passes them). Reads configs only."""
    index = folder / _INDEX
    if index.stat() is None:
        raise CheckpointError(f"{folder}: no {_INDEX}; sw.from_pretrained({cls.__name__}, ...) reads a "
                              "pipeline folder as DiffusionPipeline.save_pretrained writes it")
    entries = read_json(index, what=f"the pipeline's {_INDEX}")
    expected, optional = cls._get_signature_keys(cls)  # type: ignore[attr-defined]  # diffusers' own
    # diffusers' split: the init's arguments without a default, and its _optional_components,
    # are components; the others are settings
    names = [k for k in entries if not k.startswith("_") and k in expected]
    settings = {k: entries[k] for k in optional if k in entries and k not in given}
    unknown = sorted(set(given) - set(expected) - set(optional))
    if unknown:
        raise UsageError(f"{cls.__name__} takes no component {unknown}; its components: {sorted(expected)}")
    if shard is not None:
        shard = set([shard] if isinstance(shard, str) else shard)
        stray = sorted(shard - set(names))
        if stray:
            raise UsageError(f"shard= names {stray}, not components of {folder} ({sorted(names)})")
    _check_dtype(dtype, names)
    optional_components = set(getattr(cls, "_optional_components", ()))
    missing = sorted(set(expected) - optional_components - set(names) - set(given))
    if missing:
        raise CheckpointError(f"{index} lists no {missing}, which {cls.__name__} needs; pass them "
                              f"built yourself ({missing[0]}=...) or use the folder save_pretrained wrote")
    out = []
    for name in names:
        if name in given:
            continue
        component_cls = _component_class(name, entries[name], index)
        if component_cls is None:
            continue
        sub = folder / name
        if not sub.is_folder():
            raise CheckpointError(f"{folder}: no folder {name!r}, which {_INDEX} lists as "
                                  f"{'.'.join(entries[name])}; the pipeline folder is incomplete "
                                  f"(copy it whole), or pass {name}=... built yourself")
        out.append(_classify(name, component_cls, sub, degree, shard, _dtype_of(dtype, name)))
    return out, settings


def _load_one(c: Component, mesh, load_options: dict, load_model: Callable[..., Any]) -> Any:
    if c.how == "plain":
        with config_folder(c.folder, None, cap=_PLAIN_CAP) as local:
            return c.cls.from_pretrained(local)  # type: ignore[attr-defined]
    # A model without a plan is read whole by every rank onto its device (an empty plan), through
    # the same door as the sharded ones: the same config handling, and sw.save writes it back.
    plan = "auto" if c.how == "shard" else {}
    return load_model(c.cls, c.folder, mesh=mesh, dtype=c.dtype, plan=plan, **load_options)


def load_pipeline(cls: type, path: str | os.PathLike | Location, *, mesh, load_model: Callable[..., Any],
                  dtype=None, shard: Iterable[str] | None = None, storage_options: dict | None = None,
                  **kwargs) -> Any:
    """``cls`` (a diffusers pipeline class) from the pipeline folder ``path``: the sharded
    components through ``load_model`` (``sw.from_pretrained``, which calls this), the rest whole
    on this rank's device. ``kwargs``: components built already (``transformer=model``) and
    ``sw.load`` options. ``path``: a folder, local or at a URL (``storage_options``), or its
    :class:`Location`. Collective."""
    folder = locate(path, storage_options)
    if not folder.is_folder():
        raise CheckpointError(f"{folder}: no such folder; sw.from_pretrained({cls.__name__}, ...) reads a "
                              "pipeline folder as DiffusionPipeline.save_pretrained writes it")
    if cls.__name__ == "DiffusionPipeline":  # the auto class: the one model_index.json names
        cls = _named_pipeline(folder)
    expected, optional = cls._get_signature_keys(cls)  # type: ignore[attr-defined]
    given = {k: v for k, v in kwargs.items() if k in expected or k in optional}
    load_options = {k: v for k, v in kwargs.items() if k not in given}
    dims = decode_mesh(mesh)
    error: Exception | None = None
    components: list[Component] = []
    settings: dict[str, Any] = {}
    try:
        components, settings = plan_components(cls, folder, degree=dims.degree, given=given, shard=shard,
                                               dtype=dtype)
    except Exception as e:  # every rank raises, before any rank reads a weight
        error = e
    agree(dims.comm_backend, error, what=f"checking the pipeline at {folder}")
    built = {**settings, **given}
    results = {}
    for c in components:
        built[c.name] = _load_one(c, mesh, load_options, load_model)
        if c.how != "plain":
            results[c.name] = built[c.name].result
    for name in expected:
        built.setdefault(name, None)
    pipe = cls(**built)
    pipe.__dict__["result"] = results  # the LoadResult of each model component
    return pipe


def _named_pipeline(folder: Location) -> type:
    import diffusers

    if (folder / _INDEX).stat() is None:
        raise CheckpointError(f"{folder}: no {_INDEX}; pass a pipeline folder as "
                              "DiffusionPipeline.save_pretrained writes it")
    name = read_json(folder / _INDEX, what=f"the pipeline's {_INDEX}").get("_class_name")
    cls = getattr(diffusers, str(name), None)
    if not (isinstance(cls, type) and is_pipeline(cls)):
        raise UnsupportedModelError(f"{folder / _INDEX}: _class_name {name!r} is not a pipeline class of "
                                    f"diffusers {diffusers.__version__}; pass the pipeline class yourself")
    return cls


# ---- save ---------------------------------------------------------------------------------------

def save_pipeline(pipe: Any, path: str | os.PathLike, *, overwrite: bool = False, **save_kwargs) -> None:
    """``pipe``'s folder at ``path`` (local or a storage's URL) as
    ``DiffusionPipeline.save_pretrained`` writes it: the models through ``sw.save`` (sharded ones
    gathered, or ``distributed=True``), the others' ``save_pretrained`` on rank 0 (into a
    temporary folder, then copied through the storage), ``model_index.json``. One storage
    transaction (``Saving``): written aside and moved into place once complete, so an
    interrupted save leaves nothing at ``path`` (the next save removes what it left). Collective."""

    if save_kwargs.get("async_save"):
        raise UsageError("async_save=True saves one model; a pipeline saves its components one after "
                         "another: drop async_save")
    save_kwargs.pop("async_save", None)
    target = target_path(locate(path, save_kwargs.pop("storage_options", None)))
    backend = world_backend()
    error: Exception | None = None
    replaceable: tuple[str, ...] = ()
    if target.is_folder() and target.list():
        try:
            replaceable = _replaceable_pipeline(target, overwrite)
        except UsageError as e:
            error = e
    agree(backend, error, what=f"saving a pipeline to {target}")
    with Saving(target, overwrite=overwrite, backend=backend, replaceable=replaceable,
                what="the pipeline at {target}") as saving:
        folder = saving.folder
        components = {name: getattr(pipe, name) for name in _component_names(pipe)}
        models = {n: c for n, c in components.items()
                  if isinstance(c, nn.Module) and library_of(c) is not None}
        try:  # collective: a model's save raises on every rank alike
            for name, model in models.items():
                save(model, folder / name, **save_kwargs)
        except Exception as e:
            error = e
        if error is None and this_rank() == 0:  # then rank 0 alone, the others waiting in agree
            try:
                _save_plain(pipe, {n: c for n, c in components.items() if n not in models}, folder)
            except Exception as e:
                error = e
        agree(backend, error, what=f"saving a pipeline to {target}")
        saving.commit()


def _save_plain(pipe: Any, plain: dict[str, Any], folder: Location) -> None:
    """The components that are no models (scheduler, tokenizers) and ``model_index.json``, by the
    library's ``save_pretrained``: into ``folder`` where it is local, else into a temporary
    folder whose files are then written to the storage (the library writes local files only)."""
    if folder.scheme is None:
        local = folder.local_path("a diffusers pipeline")
        for name, component in plain.items():
            if component is not None:
                component.save_pretrained(local / name)
        pipe.save_config(local)
        return
    with tempfile.TemporaryDirectory(prefix="shardwise-pipeline-") as scratch:
        _save_plain(pipe, plain, locate(scratch))
        for file in sorted(p for p in Path(scratch).rglob("*") if p.is_file()):
            write_small(folder / file.relative_to(scratch).as_posix(), file.read_bytes())


def _replaceable_pipeline(target: Location, overwrite: bool) -> tuple[str, ...]:
    """What an ``overwrite`` may replace at the existing ``target``: a pipeline's
    ``model_index.json`` and the components it names (a local folder's whole, an object
    store's objects under them), nothing else; a ``UsageError`` without ``overwrite`` or where
    ``target`` holds no pipeline."""
    if not overwrite:
        raise UsageError(f"{target} exists; pass overwrite=True to replace the pipeline there once the new "
                         "one is complete, or save to another path")
    index = target / _INDEX
    if index.stat() is None:
        raise UsageError(f"{target} exists and holds no {_INDEX}: overwrite=True replaces a "
                         "pipeline folder only; remove it first or save to another path")
    try:
        config = read_json(index, what=f"the pipeline's {_INDEX}")
    except CheckpointError as e:
        raise UsageError(f"{index}: unreadable ({e}); remove {target} first or save to another path") from e
    names = [k for k, v in config.items() if not k.startswith("_") and isinstance(v, list)]
    # an object store's: each component's objects, and the record its save leaves beside it
    return (_INDEX, *(pattern for n in names for pattern in (f"{n}/", f"{n}/*", f".{n}{DONE_MARK}")))


def _component_names(pipe: Any) -> list[str]:
    """The pipeline's components (not its settings: Wan's ``boundary_ratio``), as diffusers saves."""
    expected, _ = pipe._get_signature_keys(pipe)
    return sorted(k for k in pipe.config if k in expected)


class Pipelines(ModelAdapter):
    """The adapter of diffusers pipelines: it claims no model; ``sw.save`` of a pipeline (not a
    module) reaches :func:`save_pipeline` through it."""

    name = "diffusers-pipeline"

    def save_collection(self, obj: object, path, options: dict) -> bool:
        if not is_pipeline(obj):
            return False
        save_pipeline(obj, path, **options)
        return True


register_adapter(Pipelines())


__all__ = ["Component", "is_pipeline", "load_pipeline", "plan_components",
           "save_pipeline"]
