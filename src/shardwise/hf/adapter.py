"""The Hugging Face adapter: everything shardwise knows of transformers and diffusers models,
answered through ``core.adapter.ModelAdapter`` and registered when ``import shardwise`` runs.

Where each answer comes from:

- plans and the base-model prefix: ``hf.plans`` (attributes only, so a model that follows
  the conventions without the libraries' classes gets them too);
- the hub key layout, read (``hf.hub_layout``: transformers' conversion mapping as region
  maps) and written back (``hf.hub_save``: its revert, checked against the read);
- the side files and the models built from a folder: ``hf.files``;
- the guards against quantizers, accelerate, diffusers' offload and peft: ``hf.guards``;
- the known-model checks that ``resolve_plan`` runs: ``hf.model_checks`` (registered with
  ``core.plan`` on import).

Light to import: transformers and diffusers are imported only inside the calls that need
them, and only for a model or folder of theirs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from shardwise.core.adapter import ModelAdapter, Shapes, register_adapter
from shardwise.core.header import NamedDtype, dtype_to_str, str_to_dtype
from shardwise.core.pieces import Composite, StoredPart
from shardwise.hf import files, guards, hub_layout, hub_save, model_checks, plans
from shardwise.io.storage import Location

assert model_checks  # imported for its registrations with core.plan


class HuggingFace(ModelAdapter):
    """transformers and diffusers models, and models that follow their plan conventions."""

    name = "huggingface"
    side_files = files.SIDE_FILES

    def claims(self, model: nn.Module) -> bool:
        return files.library_of(model) is not None or plans.speaks_plans(model)

    def base_prefix(self, model: nn.Module) -> str:
        return plans.base_prefix(model)

    def shipped_plan(self, model: nn.Module, axis: str) -> dict:
        return plans.shipped_plan(model, axis)

    def refuse(self, model: nn.Module, action: str) -> None:
        guards.refuse(model, action)

    def stored_tensors(self, model: nn.Module, stored: Mapping[str, tuple[Location | None, NamedDtype]],
                       wanted: set[str], shapes: Mapping[str, tuple[int, ...]] | None = None,
                       ) -> tuple[dict[str, Composite], set[str]]:
        return hub_layout.hub_tensors(model, stored, wanted, None if shapes is None else dict(shapes))

    def save_layout(self, model: nn.Module, tensors: Shapes) -> list[StoredPart] | None:
        return hub_save.hub_save_layout(model, dict(tensors))

    def unsaved(self, model: nn.Module) -> frozenset[str]:
        return frozenset(getattr(model, "_keys_to_ignore_on_save", None) or ())  # as save_pretrained

    def stored_names(self, model: nn.Module, tensors: Shapes) -> dict[str, tuple[tuple[int, ...], str]]:
        if not hub_layout.is_transformers_model(model):
            return dict(tensors)
        meta = {n: torch.empty(shape, dtype=str_to_dtype(dt), device="meta")
                for n, (shape, dt) in tensors.items()}
        reverted = hub_save.revert(model, meta, "use layout='module'")
        if reverted is None:  # transformers is not installed: the module's names
            return dict(tensors)
        return {k: (tuple(t.shape), dtype_to_str(t.dtype)) for k, t in reverted.items()}

    def shared_storages(self, parts: list[StoredPart], itemsize: Mapping[str, int]) -> dict:
        return hub_save.shared_storages(parts, dict(itemsize))

    def file_prefix(self, model: nn.Module) -> str:
        return files.default_prefix(model)

    def index_metadata(self, model: nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> dict:
        # a diffusers index has no total_parameters
        return {} if files.library_of(model) == "diffusers" else super().index_metadata(model, shapes)

    def write_side_files(self, model: nn.Module, folder: Location) -> list[str]:
        return files.write_side_files(model, folder)

    def model_from_folder(self, folder: Location, *, need: bool = False) -> nn.Module | None:
        return files.model_from_folder(folder, need=need)

    def quantization_config(self, folder: Location) -> tuple[object, Location] | None:
        return files.quantization_config(folder)

    def model_from_config(self, config_file: Path) -> nn.Module | None:
        return files.model_from_config(config_file)


ADAPTER = register_adapter(HuggingFace())

__all__ = ["ADAPTER", "HuggingFace"]
