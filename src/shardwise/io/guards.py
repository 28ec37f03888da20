"""Guards: refuse what shardwise cannot load or save, before any read, write or collective.

Each check is pure inspection of Python objects (module classes, attributes, tensor types
and dtypes, the world size already known to this process): no file is opened and no
collective runs, so a refused model fails the same way on every rank, at once, without
leaving a peer waiting in a collective. Optional packages (accelerate, diffusers, peft,
bitsandbytes, torchao) are recognised by attribute and class names, never imported.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.core.quant_layout import fp8_block_of, fp8_expert_pairs, quant_pairs
from shardwise.errors import MeshError, UnsupportedModelError

# Tensor types a checkpoint path handles as is; anything else wraps its data.
_PLAIN_TENSOR_TYPES = ("Tensor", "Parameter", "DTensor", "Buffer")
_BNB_PARAM_TYPES = ("Params4bit", "Int8Params")
_QUANT_MODULE_TYPES = ("Linear4bit", "Linear8bitLt", "LinearNF4", "Float8Linear", "QuantizedLinear")
_QUANT_TENSOR_MARKS = ("Float8", "AffineQuantized", "NF4", "Int4", "Int8", "Quantized", "Fp8")
SUPPORTED_QUANT = ("FP8 with block scales (quant_method 'fp8', weight_block_size [128, 128] and others: "
                   "transformers' FP8Linear) and MXFP4 (quant_method 'mxfp4': gpt-oss's experts as "
                   "x_blocks / x_scales, one e8m0 scale per 32 e2m1 values)")
_GROUP_OFFLOAD_HOOKS = ("group_offloading", "lazy_prefetch_group_offloading")
_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                              "float8_e5m2fnuz") if hasattr(torch, n))


def _refuse(action: str, cause: str, fix: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"cannot {action} this model: {cause}; {fix}")


def check_model(model: nn.Module, *, action: str) -> None:
    """Raise ``UnsupportedModelError`` if ``model`` is quantized, placed or offloaded by
    accelerate or diffusers, or carries PEFT/LoRA layers; ``action`` ("load", "save", ...)
    goes into the message. Pure inspection: no file access, no collective.

    >>> check_model(torch.nn.Linear(2, 2), action="load")
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{action}: model must be a torch.nn.Module, got {type(model).__name__}")
    _check_quantization_config(model, action)
    _check_placement(model, action)
    _check_peft(model, action)
    _check_quantized_tensors(model, action)


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
        raise _refuse(action, f"it is quantized{scheme} ({where} is set){why}",
                      f"shardwise reads and writes unquantized weights and {SUPPORTED_QUANT} only; load "
                      "the original (unquantized) model, shard it with shardwise, then quantize each shard")
    configured = [quant_scheme(v)[0] for w, v in found if w.startswith("model.config.")]
    if action == "save" and configured and not any(quant_pairs(m) for m in model.modules()):
        method = configured[0]
        raise _refuse(action, f"model.config.quantization_config says {method} but no module holds "
                      f"{str(method).upper()} weights (a dequantized model?), so its config.json would "
                      "describe weights it does not hold",
                      "delete model.config.quantization_config before saving (sw.load(..., dequantize=True) "
                      "does), or save the model with its quantized modules")


def quant_scheme(qc) -> tuple[str | None, str | None]:
    """``(quant_method, None)`` for a quantization config shardwise supports (FP8 with block
    scales: ``quant_method`` ``"fp8"``, a ``weight_block_size`` of two ints, float32 scales,
    dynamic activations, no FP4 experts; MXFP4: ``quant_method`` ``"mxfp4"``, gpt-oss's
    experts); ``(quant_method, why not)`` for any other."""
    if isinstance(qc, str):  # bitsandbytes' flags on the model
        return qc, ""

    def get(name):
        return qc.get(name) if isinstance(qc, dict) else getattr(qc, name, None)

    method = get("quant_method")
    method = str(getattr(method, "value", method)) if method is not None else None
    if method == "mxfp4":  # fixed layout: 32 values a scale (its dequantize flag is a load option)
        return method, None
    if method != "fp8":
        return method, ""
    block = get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        return method, f"; weight_block_size is {block!r}: per-tensor FP8 scales are not supported yet"
    for name, ok in (("scale_fmt", ("float", None)), ("activation_scheme", ("dynamic", None)),
                     ("expert_dtype", ("fp8", None))):
        if get(name) not in ok:
            return method, f"; its {name} is {get(name)!r} (supported: {ok[0]!r})"
    return method, None


def _check_quantized_tensors(model: nn.Module, action: str) -> None:
    fix = (f"shardwise reads and writes unquantized weights and {SUPPORTED_QUANT} only; build the model "
           "without quantization (no torchao quantize_, no bitsandbytes layers), load it, then quantize")
    for path, module in model.named_modules():
        cls = type(module).__name__
        if fp8_block_of(module) is not None:
            _check_fp8_linear(path, module, action)
            continue
        if fp8_expert_pairs(module):
            _check_fp8_experts(path, module, action)
            continue
        if quant_pairs(module):  # MXFP4: uint8 blocks and scales, as stored
            continue
        if cls in _QUANT_MODULE_TYPES:
            raise _refuse(action, f"module {path or '<root>'!r} is a quantized layer ({cls})", fix)
        tensors = dict(module.named_parameters(recurse=False))
        tensors.update(module.named_buffers(recurse=False))
        for name, t in tensors.items():
            if t is None:
                continue
            full = f"{path}.{name}" if path else name
            tcls = type(t).__name__
            if tcls in _BNB_PARAM_TYPES:
                raise _refuse(action, f"parameter {full!r} is a bitsandbytes {tcls}", fix)
            if tcls not in _PLAIN_TENSOR_TYPES:
                kind = ("a quantized tensor subclass" if any(m in tcls for m in _QUANT_TENSOR_MARKS)
                        else "a tensor subclass shardwise does not know")
                raise _refuse(action, f"{full!r} is {kind} ({tcls})",
                              fix if "quantized" in kind else
                              "convert it to a plain torch.Tensor (or DTensor) before calling shardwise")
        scales = [n for n in tensors if "scale" in n.lower()]
        if not scales:
            continue
        params = dict(module.named_parameters(recurse=False))
        for name, t in tensors.items():
            if t is None or name in scales:
                continue
            if ("weight" in name.lower() and _is_quantized_dtype(t.dtype)) or (
                    name in params and t.dtype in _FLOAT8):  # FP8 experts: gate_up_proj, down_proj
                full = f"{path}.{name}" if path else name
                raise _refuse(action, f"{full!r} holds {t.dtype} values next to the scale tensor "
                              f"{scales[0]!r} (quantized weights)", fix)


def _check_fp8_linear(path: str, module: nn.Module, action: str) -> None:
    """An FP8 block-scaled linear (``core.quant_layout.fp8_block_of``) as shardwise holds it:
    float8_e4m3fn values, float32 scales, no static activation scale."""
    weight, scale = module.weight, module.weight_scale_inv
    static = getattr(module, "activation_scale", None) is not None
    problem = (f"its weight is {weight.dtype}" if weight.dtype != torch.float8_e4m3fn
               else f"its weight_scale_inv is {scale.dtype} (ue8m0 scales?)" if scale.dtype != torch.float32
               else "it has a static activation_scale" if static else None)
    if problem is not None:
        raise _refuse(action, f"FP8 module {path!r} ({type(module).__name__}): {problem}",
                      f"shardwise supports {SUPPORTED_QUANT} with float8_e4m3fn weights, float32 scales and "
                      "dynamic activations; dequantize this checkpoint first")


def _check_fp8_experts(path: str, module: nn.Module, action: str) -> None:
    """FP8 experts (``core.quant_layout.fp8_expert_pairs``) as shardwise holds them: every
    projection float8_e4m3fn with float32 scales, dynamic activations."""
    for values, scales, _ in fp8_expert_pairs(module):
        v, s = module._parameters[values], module._parameters[scales]
        assert v is not None and s is not None  # fp8_expert_pairs lists present parameters only
        problem = (f"its {values} is {v.dtype}" if v.dtype != torch.float8_e4m3fn
                   else f"its {scales} is {s.dtype} (ue8m0 scales?)" if s.dtype != torch.float32
                   else "it has static activation scales" if getattr(module, "activation_scheme", "dynamic")
                   != "dynamic" else None)
        if problem is not None:
            raise _refuse(action, f"FP8 experts {path!r} ({type(module).__name__}): {problem}",
                          f"shardwise supports {SUPPORTED_QUANT} with float8_e4m3fn weights, float32 scales "
                          "and dynamic activations; dequantize this checkpoint first")


def _is_quantized_dtype(dtype: torch.dtype) -> bool:
    return dtype in _FLOAT8 or not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _check_placement(model: nn.Module, action: str) -> None:
    if getattr(model, "hf_device_map", None) is not None:
        raise _refuse(action, "it was placed by accelerate (model.hf_device_map is set)",
                      "build the model without device_map= (on the meta device: "
                      "`with torch.device('meta'):`) and let shardwise place each shard on its rank")
    for path, module in model.named_modules():
        where = path or "<root>"
        if getattr(module, "_hf_hook", None) is not None:
            hook = type(module._hf_hook).__name__
            raise _refuse(action, f"module {where!r} carries an accelerate hook ({hook}: device placement "
                          "or CPU/disk offload)",
                          "remove it first (accelerate.hooks.remove_hook_from_module(model, recurse=True)) "
                          "or build the model without device_map/offloading")
        registry = getattr(module, "_diffusers_hook", None)
        if registry is not None:
            names = _hook_names(registry)
            hit = next((n for n in names if n in _GROUP_OFFLOAD_HOOKS), None)
            if hit is not None:
                raise _refuse(action, f"module {where!r} is group-offloaded by diffusers (hook {hit!r})",
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
            raise _refuse(action, f"PEFT adapters are attached (peft_config on {where!r})", fix)
        cls = type(module).__name__
        if cls.startswith("Lora") or cls.startswith("PeftModel"):
            raise _refuse(action, f"module {where!r} is a PEFT layer ({cls})", fix)
        if hasattr(module, "lora_A") or hasattr(module, "lora_B"):
            raise _refuse(action, f"module {where!r} has LoRA layers injected (lora_A/lora_B, class {cls})",
                          fix)


def check_mesh(mesh) -> None:
    """Raise ``MeshError`` if ``mesh`` is missing or spans more devices than the world.

    Reads only what this process knows (the world size of its process group): no collective.
    """
    import torch.distributed as dist

    if mesh is None:
        raise MeshError("mesh is required; build one with sw.init_backend(...).mesh(tp=N)")
    if not dist.is_available() or not dist.is_initialized():
        raise MeshError("no process group is running; call sw.init_backend(...) before building the mesh")
    if getattr(mesh, "spmd", False):  # an SPMD mesh counts devices, all driven by this process
        return
    size = int(mesh.size())
    world = dist.get_world_size()
    if size > world:
        raise MeshError(
            f"the mesh has {size} devices but the world has only {world} processes; launch "
            f"{size} ranks (torchrun --nproc-per-node {size}) or build a mesh of at most {world} "
            "with backend.mesh(tp=...)"
        )


# Options a user may bring over from from_pretrained that have no streaming meaning.
_NON_STREAMING = {
    "device_map": "shardwise places each rank's shard on that rank's device itself; drop device_map "
                  "and pass mesh= (every rank reads only its slice)",
    "max_memory": "per-device memory limits belong to accelerate's placement; drop max_memory: each rank "
                  "holds only its 1/degree of the model",
    "offload_folder": "offloading to disk cannot be combined with streaming shards; drop offload_folder",
    "offload_state_dict": "offloading cannot be combined with streaming shards; drop offload_state_dict",
    "quantization_config": "shardwise reads the checkpoint's own quantization (its config.json); pass "
                           "dequantize=True to get the weights in the model's dtype instead",
}


def check_options(*, _where: str = "load", **options) -> None:
    """Raise ``UnsupportedModelError`` for an option that cannot stream (``device_map``, ...)
    and ``TypeError`` for an option ``_where`` does not know. ``None`` values are ignored.

    >>> check_options(device_map=None)
    """
    for name, value in options.items():
        if name in _NON_STREAMING:
            if value is not None:
                raise UnsupportedModelError(f"{_where}: option {name}={value!r} cannot stream: "
                                            f"{_NON_STREAMING[name]}")
            continue
        raise TypeError(f"{_where}() got an unexpected keyword argument {name!r}")


__all__ = ["SUPPORTED_QUANT", "check_mesh", "check_model", "check_options", "quant_scheme"]
