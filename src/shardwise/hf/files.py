"""The files besides the weights that make a Hugging Face checkpoint (``config.json``,
``generation_config.json``), written as ``save_pretrained`` writes them, and read back into a
meta-device model when a tool has a folder and no model. A library is imported only to build
a model from a folder that names one of its classes."""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from shardwise.errors import CheckpointError
from shardwise.io.storage import Location, locate, read_json, read_small, write_small

if TYPE_CHECKING:
    from diffusers.configuration_utils import ConfigMixin
    from transformers import PreTrainedModel

# Written by a save (replaced with the checkpoint by overwrite=True), copied by a consolidation.
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


def write_side_files(model: nn.Module, folder: Location) -> list[str]:
    """Write the model's config files into ``folder`` as its ``save_pretrained`` would; return
    their names ([] for a model of neither library, or without a config)."""
    # The libraries write configs to a local folder only: they are written into a temporary
    # one and copied through the storage.
    with tempfile.TemporaryDirectory() as tmp:
        names = _save_configs(model, Path(tmp))
        for name in names:
            write_small(folder / name, read_small(locate(tmp) / name, what="a config"))
    return names


def _save_configs(model: nn.Module, folder: Path) -> list[str]:
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


@contextmanager
def config_folder(folder: Location) -> Iterator[Path]:
    """A local folder holding ``folder``'s config files (:data:`SIDE_FILES`), for the
    libraries' ``from_pretrained`` of a config (they read local files only): the folder
    itself, else a temporary copy of them."""
    if folder.scheme is None:
        yield folder.local_path("a library's config reader")
        return
    with tempfile.TemporaryDirectory() as tmp:
        for name in SIDE_FILES:
            if (folder / name).stat() is not None:
                write_small(locate(tmp) / name, read_small(folder / name, what="a config"))
        yield Path(tmp)


def model_from_folder(folder: Location, *, need: bool = False) -> nn.Module | None:
    """A meta-device transformers model built from ``folder/config.json`` (its
    ``architectures``), to name a checkpoint's hub layout without the model in hand; None
    when the folder has no transformers config or transformers cannot build it here. With
    ``need`` (a consolidation, which must know the layout), a config that names a
    transformers model while transformers is not installed raises ``CheckpointError``."""
    config_file = folder / "config.json"
    try:
        if config_file.stat() is None:
            return None
        config = read_json(config_file, what="the config")
        arch = (config.get("architectures") or [None])[0]
    except (OSError, CheckpointError, AttributeError):
        return None
    if not isinstance(arch, str):
        return None
    try:
        import transformers
    except ImportError:
        if need and "transformers_version" in config:
            raise CheckpointError(
                f"{config_file} names a transformers model, whose hub layout (the keys save_pretrained "
                "writes) only transformers can compute, and transformers is not installed here; install "
                "it, or pass layout='module' to write the model's own tensor names") from None
        return None
    cls = getattr(transformers, arch, None)
    if cls is None:
        return None
    try:
        with config_folder(folder) as local:
            config_obj = transformers.AutoConfig.from_pretrained(local)
        with torch.device("meta"):
            return cls._from_config(config_obj)
    except Exception as e:  # noqa: BLE001 - transformers raises anything for a config it cannot build
        raise CheckpointError(f"{config_file}: transformers cannot build {arch} from it ({type(e).__name__}: "
                              f"{e}); consolidate with layout='module'") from e


def quantization_config(folder: Location) -> tuple[object, Location] | None:
    """``(the quantization_config of the folder's config.json or None, that file)``; None when
    the folder has no config.json. Read through the folder's storage (capped, strict JSON)."""
    config_file = folder / "config.json"
    if config_file.stat() is None:
        return None
    try:
        return read_json(config_file, what="the config").get("quantization_config"), config_file
    except (OSError, CheckpointError):
        return None, config_file


def model_from_config(config_file: Path) -> nn.Module | None:
    """The meta-device model a transformers (``architectures``) or diffusers (``_class_name``)
    local config.json (``verify``'s ``against=``) describes; None when it names neither.
    Raises ``CheckpointError`` when it names one that cannot be built here (library missing,
    class unknown, config refused)."""
    try:
        config = json.loads(Path(config_file).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config_file}: not a readable JSON config ({e})") from e
    arch = (config.get("architectures") or [None])[0] if isinstance(config, dict) else None
    name = config.get("_class_name") if isinstance(config, dict) and arch is None else arch
    if not isinstance(name, str):
        return None
    library = "transformers" if arch is not None else "diffusers"
    try:
        module = __import__(library)
    except ImportError as e:
        raise CheckpointError(f"{config_file}: describes a {library} model ({name}), and {library} is "
                              "not installed") from e
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise CheckpointError(f"{config_file}: {library} has no class {name!r} (custom code?); pass "
                              "the model itself (built on meta)")
    model_class: Any = cls  # a transformers / diffusers model class: their API, untyped here
    try:
        with torch.device("meta"):
            if library == "transformers":
                return model_class._from_config(module.AutoConfig.from_pretrained(config_file))
            return model_class.from_config(model_class.load_config(config_file))
    except Exception as e:  # noqa: BLE001 - the libraries raise anything for a config they cannot build
        raise CheckpointError(f"{config_file}: {library} cannot build {name} from it "
                              f"({type(e).__name__}: {e})") from e


__all__ = ["DIFFUSERS_PREFIX", "SIDE_FILES", "config_folder", "default_prefix",
           "library_of", "model_from_config", "model_from_folder", "quantization_config", "write_side_files"]
