"""The Hugging Face adapter (``core.adapter.ModelAdapter``), registered on ``import shardwise``:
shipped plans, the hub key layout, side files, guards and the known-model checks of
``resolve_plan``, from attributes and class names; a library is imported only inside a call."""

from __future__ import annotations

import copy
import functools
import inspect
import json
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.adapters import attached
from shardwise.core.adapter import ModelAdapter, Shapes, register_adapter
from shardwise.core.header import MAX_HEADER_SIZE, NamedDtype, dtype_to_str
from shardwise.core.pieces import Composite, StoredPart
from shardwise.core.plan import register_model_check
from shardwise.core.quant_layout import quant_pairs
from shardwise.core.walk import attribute, has_attribute, named_modules
from shardwise.errors import CheckpointError, PlanError
from shardwise.hf import hub_layout
from shardwise.hf.encoder_plans import encoder_plan
from shardwise.hf.hub_layout import library_of
from shardwise.io.guards import SUPPORTED_QUANT, quant_scheme, refusal
from shardwise.io.storage import Location, locate, read_json, read_small, write_small

# transformers: the class's ``_tp_plan``, the config's ``base_model_tp_plan`` (keys written for
# the base model) and the merged ``model.tp_plan`` of a loaded model; ep likewise. diffusers:
# ``_tp_plan``. Read by attribute, so a model following the conventions without the libraries'
# classes (the validation suite's) gets the same answers.
_SHIPPED = {"tp": (("tp_plan", "_tp_plan"), "base_model_tp_plan"),
            "ep": (("ep_plan",), "base_model_ep_plan")}
# Written by a save (replaced with the checkpoint by overwrite=True), copied by a consolidation.
SIDE_FILES = ("config.json", "generation_config.json")


@contextmanager
def config_folder(folder: Location, names: Sequence[str] | None = SIDE_FILES, *,
                  cap: int = MAX_HEADER_SIZE) -> Iterator[Path]:
    """A local folder holding ``folder``'s ``names`` (those there; None: every object in it, as
    a scheduler's, tokenizer's or processor's files, of at most ``cap`` bytes each), for the
    libraries' readers (they read local files only): the folder itself, else a temporary copy."""
    if folder.scheme is None:
        yield folder.local_path("a library's reader")
        return
    with tempfile.TemporaryDirectory() as tmp:
        what = "a config" if names is not None else "a component's file"
        for name in folder.list() if names is None else names:
            if (folder / name).stat() is not None:
                write_small(locate(tmp) / name, read_small(folder / name, what=what, cap=cap))
            elif names is None:  # a folder: none of these components has one
                raise CheckpointError(f"{folder / name}: a folder inside a scheduler, tokenizer or processor "
                                      "component, which this load does not copy; download the pipeline")
        yield Path(tmp)


def build_model(cls: Any, config: Path, **kwargs) -> nn.Module:
    """``cls`` (a transformers model or Auto class, or a diffusers model class) built by its library
    from the local ``config`` (a file or a folder), on the current device; ``kwargs`` to transformers."""
    if library_of(cls) == "diffusers":
        return cls.from_config(cls.load_config(config))
    import transformers

    if cls.__module__.startswith("transformers.models.auto"):
        return cls.from_config(transformers.AutoConfig.from_pretrained(config), **kwargs)
    config_cls = getattr(cls, "config_class", None) or transformers.AutoConfig
    return cls._from_config(config_cls.from_pretrained(config), **kwargs)


def _meta_model(cls: Any, config: Path, config_file: object, fix: str = "") -> nn.Module:
    """:func:`build_model` on meta; ``CheckpointError`` naming ``config_file`` if the library refuses."""
    try:
        with torch.device("meta"):
            return build_model(cls, config)
    except Exception as e:  # noqa: BLE001 - the libraries raise anything for a config they cannot build
        library = library_of(cls) or "transformers"
        raise CheckpointError(f"{config_file}: {library} cannot build {cls.__name__} from it "
                              f"({type(e).__name__}: {e}){fix}") from e


class HuggingFace(ModelAdapter):
    """transformers and diffusers models, and models that follow their plan conventions."""

    name = "huggingface"
    side_files = SIDE_FILES

    def claims(self, model: nn.Module) -> bool:
        return (library_of(model) is not None or bool(self.base_prefix(model))
                or any(self.shipped_plan(model, axis) for axis in _SHIPPED))

    def base_prefix(self, model: nn.Module) -> str:
        """``model.base_model_prefix`` when it names a submodule other than the model, else ""."""
        prefix = getattr(model, "base_model_prefix", "")
        inner = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
        return prefix if isinstance(inner, nn.Module) and inner is not model else ""

    def shipped_plan(self, model: nn.Module, axis: str) -> dict:
        """The first non-empty plan among the model's attributes for ``axis``, else its config's
        ``base_model_{axis}_plan`` with each key under the base-model prefix, else for tp the plan
        shardwise ships for a transformers class without one (``hf.encoder_plans``); ``{}``."""
        attrs, config_attr = _SHIPPED[axis]
        for attr in attrs:
            plan = getattr(model, attr, None)
            if isinstance(plan, Mapping) and plan:
                return dict(plan)
        base = getattr(getattr(model, "config", None), config_attr, None)
        if isinstance(base, Mapping) and base:
            prefix = self.base_prefix(model)
            return {f"{prefix}.{k}" if prefix else k: v for k, v in base.items()}
        if axis == "tp" and library_of(model) == "transformers":
            return encoder_plan(model)
        return {}

    def refuse(self, model: nn.Module, action: str) -> None:
        _check_quantization_config(model, action)
        _check_placement(model, action)
        _check_peft(model, action)

    def stored_tensors(self, model: nn.Module, stored: Mapping[str, tuple[Location | None, NamedDtype]],
                       wanted: set[str], shapes: Mapping[str, tuple[int, ...]] | None = None,
                       ) -> tuple[dict[str, Composite], set[str]]:
        return hub_layout.hub_tensors(model, stored, wanted, None if shapes is None else dict(shapes))

    def save_layout(self, model: nn.Module, tensors: Shapes) -> list[StoredPart] | None:
        return hub_layout.hub_save_layout(model, dict(tensors))

    def unsaved(self, model: nn.Module) -> frozenset[str]:
        return frozenset(getattr(model, "_keys_to_ignore_on_save", None) or ())  # as save_pretrained

    def stored_names(self, model: nn.Module, tensors: Shapes) -> dict[str, tuple[tuple[int, ...], str]]:
        reverted = hub_layout.revert(model, tensors, "use layout='module'")
        if reverted is None:  # not a transformers model, or transformers is not installed
            return dict(tensors)
        return {k: (tuple(t.shape), dtype_to_str(t.dtype)) for k, t in reverted.items()}

    def shared_storages(self, parts: list[StoredPart], itemsize: Mapping[str, int]) -> dict:
        return hub_layout.shared_storages(parts, dict(itemsize))

    def file_prefix(self, model: nn.Module) -> str:
        return "diffusion_pytorch_model" if library_of(model) == "diffusers" else "model"

    def index_metadata(self, model: nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> dict:
        # a diffusers index has no total_parameters
        return {} if library_of(model) == "diffusers" else super().index_metadata(model, shapes)

    def write_side_files(self, model: nn.Module, folder: Location) -> list[str]:
        """As the model's ``save_pretrained`` would; [] for a model of neither library or without
        a config."""
        hf: Any = model  # a transformers or diffusers model: their API, untyped here
        library, names = library_of(model), []
        # The libraries write configs to a local folder only: written into a temporary one and
        # copied through the storage.
        with tempfile.TemporaryDirectory() as tmp:
            if library == "transformers" and getattr(model, "config", None) is not None:
                # save_pretrained records the weights' dtype and the class on the config it
                # writes; a copy keeps the caller's config as it was.
                config = copy.deepcopy(hf.config)
                config.dtype = str(hf.dtype).split(".")[1]
                config.architectures = [type(model).__name__]
                config.save_pretrained(tmp)
                names = ["config.json"]
                if hf.can_generate() and getattr(model, "generation_config", None) is not None:
                    hf.generation_config.save_pretrained(tmp)
                    names.append("generation_config.json")
            elif library == "diffusers" and hasattr(model, "save_config"):
                hf.save_config(tmp)
                names = [hf.config_name]  # each model class sets it (ConfigMixin: None)
            for name in names:
                write_small(folder / name, read_small(locate(tmp) / name, what="a config"))
        return names

    def model_from_folder(self, folder: Location, *, need: bool = False) -> nn.Module | None:
        """A transformers model's (``architectures``) only: its hub layout is what needs naming."""
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
        with config_folder(folder) as local:
            return _meta_model(cls, local, config_file, "; consolidate with layout='module'")

    def quantization_config(self, folder: Location) -> tuple[object, Location] | None:
        config_file = folder / "config.json"
        if config_file.stat() is None:
            return None
        try:
            return read_json(config_file, what="the config").get("quantization_config"), config_file
        except (OSError, CheckpointError):
            return None, config_file

    def model_from_config(self, path: Path) -> nn.Module | None:
        """From ``architectures`` (transformers) or ``_class_name`` (diffusers) of the file
        ``path``, or of ``config.json`` in the folder ``path``; None where there is no such file."""
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            return None
        try:
            config = json.loads(Path(config_file).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{config_file}: not a readable JSON config ({e})") from e
        arch = (config.get("architectures") or [None])[0] if isinstance(config, dict) else None
        name = config.get("_class_name") if isinstance(config, dict) and arch is None else arch
        if not isinstance(name, str):
            return None
        library_name = "transformers" if arch is not None else "diffusers"
        try:
            library = __import__(library_name)
        except ImportError as e:
            raise CheckpointError(f"{config_file}: describes a {library_name} model ({name}), and "
                                  f"{library_name} is not installed") from e
        cls = getattr(library, name, None)
        if not isinstance(cls, type):
            raise CheckpointError(f"{config_file}: {library_name} has no class {name!r} (custom code?); pass "
                                  "the model itself (built on meta)")
        return _meta_model(cls, config_file, config_file)


# -- guards: run for every model (accelerate can place any module, peft wrap any one) ---------
_GROUP_OFFLOAD_HOOKS = ("group_offloading", "lazy_prefetch_group_offloading")


def _check_quantization_config(model: nn.Module, action: str) -> None:
    config = getattr(model, "config", None)
    found = [(f"model.config.{a}" if owner is config else f"model.{a}", getattr(owner, a))
             for owner in (config, model) if owner is not None
             for a in ("quantization_config", "hf_quantizer")
             if getattr(owner, a, None) not in (None, {})]
    found += [(f"model.{a}", "bitsandbytes") for a in ("is_loaded_in_4bit", "is_loaded_in_8bit")
              if getattr(model, a, False) is True]
    for where, value in found:
        method, why = quant_scheme(getattr(value, "quantization_config", value))
        if why is None:
            continue
        scheme = f" with {method!r}" if method else ""
        raise refusal(action, f"it is quantized{scheme} ({where} is set){why}",
                      f"shardwise reads and writes unquantized weights and {SUPPORTED_QUANT} only; load "
                      "the original (unquantized) model, shard it with shardwise, then quantize each shard")
    configured = [quant_scheme(v)[0] for w, v in found if w.startswith("model.config.")]
    if action == "save" and configured and not any(quant_pairs(m) for m in model.modules()):
        method = configured[0]
        raise refusal(action, f"model.config.quantization_config says {method} but no module holds "
                      f"{str(method).upper()} weights (a dequantized model?), so its config.json would "
                      "describe weights it does not hold",
                      "delete model.config.quantization_config before saving (sw.load(..., dequantize=True) "
                      "does), or save the model with its quantized modules")


def _check_placement(model: nn.Module, action: str) -> None:
    if getattr(model, "hf_device_map", None) is not None:
        raise refusal(action, "it was placed by accelerate (model.hf_device_map is set)",
                      "build the model without device_map= (on the meta device: "
                      "`with torch.device('meta'):`) and let shardwise place each shard on its rank")
    for path, module in named_modules(model):
        where = path or "<root>"
        if attribute(module, "_hf_hook") is not None:
            hook = type(module._hf_hook).__name__
            raise refusal(action, f"module {where!r} carries an accelerate hook ({hook}: device placement "
                          "or CPU/disk offload)",
                          "remove it first (accelerate.hooks.remove_hook_from_module(model, recurse=True)) "
                          "or build the model without device_map/offloading")
        registry = attribute(module, "_diffusers_hook")
        if registry is not None:
            hit = next((n for n in _hook_names(registry) if n in _GROUP_OFFLOAD_HOOKS), None)
            if hit is not None:
                raise refusal(action, f"module {where!r} is group-offloaded by diffusers (hook {hit!r})",
                              "turn group offloading off (do not call enable_group_offload / "
                              "apply_group_offloading before shardwise); tensor parallelism already "
                              "divides the memory")


def _hook_names(registry) -> list[str]:
    hooks = getattr(registry, "hooks", None)
    if isinstance(hooks, dict):
        return [str(n) for n in hooks]
    get_hook = getattr(registry, "get_hook", None)
    if callable(get_hook):
        return [n for n in _GROUP_OFFLOAD_HOOKS if get_hook(n) is not None]
    return []


def _check_peft(model: nn.Module, action: str) -> None:
    if action == "save" and attached(model):
        return  # adapters sw.load_adapter attached: sw.save writes the base (merged if merged)
    fix = ("merge the adapters first (peft: model = model.merge_and_unload(); diffusers: "
           "fuse_lora() then unload_lora_weights()), attach them with sw.load_adapter (then sw.save writes "
           "the base), or load the base model without adapters")
    for path, module in named_modules(model):
        where = path or "<root>"
        if attribute(module, "peft_config") or attribute(module, "_hf_peft_config_loaded", False) is True:
            raise refusal(action, f"PEFT adapters are attached (peft_config on {where!r})", fix)
        cls = type(module).__name__
        if cls.startswith("Lora") or cls.startswith("PeftModel"):
            raise refusal(action, f"module {where!r} is a PEFT layer ({cls})", fix)
        if has_attribute(module, "lora_A") or has_attribute(module, "lora_B"):
            raise refusal(action, f"module {where!r} has LoRA layers injected (lora_A/lora_B, class {cls})",
                          fix)


# -- known-model checks: ``resolve_plan`` runs them at every degree it tries (see ModelCheck) --
@register_model_check
def check_statistics_over_shards(model: nn.Module, owned: Mapping, degrees: Mapping[str, int]) -> None:
    """Refuse a plan that splits the features a module takes statistics over (Gemma-3n's
    activation sparsity: a top-k over ``gate_proj``'s features): each rank would see its part."""
    for path, module in named_modules(model):
        sparsity = attribute(module, "activation_sparsity", 0.0)
        gate = attribute(module, "gate_proj")
        if not (isinstance(sparsity, float) and sparsity > 0 and isinstance(gate, nn.Linear)):
            continue
        entry = owned.get(id(gate.weight))
        if entry is not None and not entry[0].replicated and degrees[entry[0].axis] > 1:
            raise PlanError(
                f"plan key {entry[2]!r} shards {entry[1]!r}, but {path!r} takes activation-sparsity "
                f"statistics (sparsity {sparsity}) over all of its intermediate features: every rank "
                "would see only its part and the output would be wrong. Keep this layer's MLP whole "
                "(drop its gate_proj/up_proj/down_proj keys) or set activation_sparsity_pattern to 0")


@register_model_check
def check_fused_halves(model: nn.Module, owned: Mapping, degrees: Mapping[str, int]) -> None:
    """Refuse a plain colwise split of a fused ``gate_up_proj`` whose forward cuts it into gate
    and up halves (``.chunk(2``, Inkling's experts): a rank would hold whole halves."""
    for _, module in named_modules(model):
        param = module._parameters.get("gate_up_proj")
        if param is None:
            continue
        entry = owned.get(id(param))
        if entry is None:
            continue
        spec = entry[0]
        if (spec.replicated or degrees[spec.axis] == 1 or len(spec.blocks) != 1
                or spec.dim != param.dim() - 2 or ".chunk(2" not in _source(type(module).forward)):
            continue
        raise PlanError(
            f"plan key {entry[2]!r} splits {entry[1]!r} plainly along its fused gate/up dim, but "
            f"{type(module).__name__}.forward cuts that dim into gate and up halves, so each rank "
            "would get whole halves instead of part of each and the output would be wrong; use "
            "'packed_colwise' for it (each half split alike)")


@functools.cache  # one read per class, not per layer of a deep MoE
def _source(forward: Callable) -> str:
    try:
        return inspect.getsource(forward)
    except (OSError, TypeError):  # no source (built in, compiled): nothing to check
        return ""


ADAPTER = register_adapter(HuggingFace())

__all__ = ["ADAPTER", "SIDE_FILES", "HuggingFace", "build_model", "check_fused_halves",
           "check_statistics_over_shards", "config_folder"]
