"""The Hugging Face adapter's guards: what transformers, diffusers, accelerate and peft do to
a model that shardwise cannot load or save, refused before any read, write or collective.

Run for every model (``core.adapter.refuse_unsupported``, called by ``io.guards.check_model``):
accelerate can place any module and peft can wrap any one. Pure inspection of attributes and
class names: none of those packages is imported.
"""

from __future__ import annotations

from torch import nn

from shardwise.core.quant_layout import quant_pairs
from shardwise.io.guards import SUPPORTED_QUANT, quant_scheme, refusal

_GROUP_OFFLOAD_HOOKS = ("group_offloading", "lazy_prefetch_group_offloading")


def refuse(model: nn.Module, action: str) -> None:
    """Raise ``UnsupportedModelError`` if ``model`` is quantized by a scheme shardwise does not
    read, placed or offloaded by accelerate or diffusers, or carries PEFT/LoRA layers."""
    _check_quantization_config(model, action)
    _check_placement(model, action)
    _check_peft(model, action)


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
    for path, module in model.named_modules():
        where = path or "<root>"
        if getattr(module, "_hf_hook", None) is not None:
            hook = type(module._hf_hook).__name__
            raise refusal(action, f"module {where!r} carries an accelerate hook ({hook}: device placement "
                          "or CPU/disk offload)",
                          "remove it first (accelerate.hooks.remove_hook_from_module(model, recurse=True)) "
                          "or build the model without device_map/offloading")
        registry = getattr(module, "_diffusers_hook", None)
        if registry is not None:
            names = _hook_names(registry)
            hit = next((n for n in names if n in _GROUP_OFFLOAD_HOOKS), None)
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
    fix = ("merge the adapters first (peft: model = model.merge_and_unload(); diffusers: "
           "fuse_lora() then unload_lora_weights()), or load the base model without adapters")
    for path, module in model.named_modules():
        where = path or "<root>"
        if getattr(module, "peft_config", None) or getattr(module, "_hf_peft_config_loaded", False) is True:
            raise refusal(action, f"PEFT adapters are attached (peft_config on {where!r})", fix)
        cls = type(module).__name__
        if cls.startswith("Lora") or cls.startswith("PeftModel"):
            raise refusal(action, f"module {where!r} is a PEFT layer ({cls})", fix)
        if hasattr(module, "lora_A") or hasattr(module, "lora_B"):
            raise refusal(action, f"module {where!r} has LoRA layers injected (lora_A/lora_B, class {cls})",
                          fix)


__all__ = ["refuse"]
