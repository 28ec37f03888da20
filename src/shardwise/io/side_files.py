"""The files besides the weights that make a Hugging Face checkpoint: ``config.json`` and
``generation_config.json``, written the way ``save_pretrained`` writes them.

A save of a transformers or diffusers model writes them next to the safetensors files, so
that the library's ``from_pretrained`` (and ``sw.from_pretrained``) loads the folder as it
is. Models are recognised by their class hierarchy and written through their own config
objects: neither library is imported here.
"""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, cast

from torch import nn

if TYPE_CHECKING:
    from diffusers.configuration_utils import ConfigMixin
    from transformers import PreTrainedModel

# Written by a save and replaced with the checkpoint by overwrite=True.
SIDE_FILES = ("config.json", "generation_config.json")
DIFFUSERS_PREFIX = "diffusion_pytorch_model"


def library_of(model: nn.Module) -> str | None:
    """``"transformers"``, ``"diffusers"`` or None, from the model's class hierarchy."""
    bases = {(c.__module__.split(".")[0], c.__name__) for c in type(model).__mro__}
    if ("transformers", "PreTrainedModel") in bases:
        return "transformers"
    if ("diffusers", "ModelMixin") in bases:
        return "diffusers"
    return None


def default_prefix(model: nn.Module) -> str:
    """The weight file prefix the model's library reads: ``diffusion_pytorch_model`` for a
    diffusers model, ``model`` otherwise."""
    return DIFFUSERS_PREFIX if library_of(model) == "diffusers" else "model"


def index_metadata(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> dict:
    """What the index's ``metadata`` carries besides ``total_size``: ``total_parameters``
    (parameters only, tied ones once, global shapes ``shapes`` of the saved tensors) as
    transformers' index has it; nothing for a diffusers model, whose index has none."""
    if library_of(model) == "diffusers":
        return {}
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {"total_parameters": sum(math.prod(s) for n, s in shapes.items() if n in params)}


def write_side_files(model: nn.Module, folder: Path) -> list[str]:
    """Write the model's config files into ``folder`` as its ``save_pretrained`` would; return
    their names ([] for a model of neither library, or without a config)."""
    library = library_of(model)
    if library == "transformers" and getattr(model, "config", None) is not None:
        hf_model = cast("PreTrainedModel", model)
        # save_pretrained records the weights' dtype and the class on the config it writes;
        # a copy keeps the caller's config as it was.
        config = copy.deepcopy(hf_model.config)
        config.dtype = str(hf_model.dtype).split(".")[1]
        config.architectures = [type(model).__name__]
        config.save_pretrained(folder)
        names = ["config.json"]
        if hf_model.can_generate() and getattr(model, "generation_config", None) is not None:
            hf_model.generation_config.save_pretrained(folder)
            names.append("generation_config.json")
        return names
    if library == "diffusers" and hasattr(model, "save_config"):
        diffusers_model = cast("ConfigMixin", model)  # its models are ConfigMixins
        diffusers_model.save_config(folder)
        return [cast(str, diffusers_model.config_name)]  # each model class sets it (ConfigMixin: None)
    return []


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the side files ``src`` holds into ``dst`` (a consolidation keeps the config)."""
    copied = []
    for name in SIDE_FILES:
        if (src / name).is_file() and not (src / name).is_symlink():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


__all__ = ["DIFFUSERS_PREFIX", "SIDE_FILES", "copy_side_files", "default_prefix", "index_metadata",
           "library_of", "write_side_files"]
