"""Guards: refuse what shardwise cannot load or save, before any read, write or collective.
Pure inspection of Python objects, so a refused model fails the same way on every rank;
optional packages are recognised by name, never imported."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.core.adapter import refuse_unsupported
from shardwise.core.quant import FLOAT8, SUPPORTED_QUANT, quant_scheme  # noqa: F401 - quant_scheme: re-exported
from shardwise.core.quant_layout import quant_pairs
from shardwise.core.walk import named_modules
from shardwise.errors import MeshError, UnsupportedModelError
from shardwise.mesh import is_spmd_mesh

# Tensor types a checkpoint path handles as is; anything else wraps its data.
_PLAIN_TENSOR_TYPES = ("Tensor", "Parameter", "DTensor", "Buffer")
_BNB_PARAM_TYPES = ("Params4bit", "Int8Params")
_QUANT_MODULE_TYPES = ("Linear4bit", "Linear8bitLt", "LinearNF4", "Float8Linear", "QuantizedLinear")
_QUANT_TENSOR_MARKS = ("Float8", "AffineQuantized", "NF4", "Int4", "Int8", "Quantized", "Fp8")


def refusal(action: str, cause: str, fix: str) -> UnsupportedModelError:
    """The error of a guard: what cannot be done to this model, why, and the fix."""
    return UnsupportedModelError(f"cannot {action} this model: {cause}; {fix}")


def check_model(model: nn.Module, *, action: str) -> None:
    """Raise ``UnsupportedModelError`` if a model adapter refuses ``model`` (quantizer, accelerate
    placement, offload hooks, PEFT) or it holds quantized layers or tensor subclasses shardwise
    does not know; ``action`` goes into the message.

    >>> check_model(torch.nn.Linear(2, 2), action="load")"""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{action}: model must be a torch.nn.Module, got {type(model).__name__}")
    refuse_unsupported(model, action)  # what a library did to it: the Hugging Face adapter's guards
    _check_quantized_tensors(model, action)


def _check_quantized_tensors(model: nn.Module, action: str) -> None:
    fix = (f"shardwise reads and writes unquantized weights and {SUPPORTED_QUANT} only; build the model "
           "without quantization (no torchao quantize_, no bitsandbytes layers), load it, then quantize")
    for path, module in named_modules(model):
        cls = type(module).__name__
        pairs = quant_pairs(module)
        if pairs:  # FP8 (a linear, or experts) or MXFP4 (uint8 blocks and scales, as stored)
            _check_fp8(path, module, pairs, action)
            continue
        if cls in _QUANT_MODULE_TYPES:
            raise refusal(action, f"module {path or '<root>'!r} is a quantized layer ({cls})", fix)
        params = {n: p for n, p in module._parameters.items() if p is not None}
        tensors = {**params, **{n: b for n, b in module._buffers.items() if b is not None}}
        for name, t in tensors.items():  # (present ones only: None filtered above)
            full = f"{path}.{name}" if path else name
            tcls = type(t).__name__
            if tcls in _BNB_PARAM_TYPES:
                raise refusal(action, f"parameter {full!r} is a bitsandbytes {tcls}", fix)
            if tcls not in _PLAIN_TENSOR_TYPES:
                kind = ("a quantized tensor subclass" if any(m in tcls for m in _QUANT_TENSOR_MARKS)
                        else "a tensor subclass shardwise does not know")
                raise refusal(action, f"{full!r} is {kind} ({tcls})",
                              fix if "quantized" in kind else
                              "convert it to a plain torch.Tensor (or DTensor) before calling shardwise")
        scales = [n for n in tensors if "scale" in n.lower()]
        if not scales:
            continue
        for name, t in tensors.items():
            if name in scales:
                continue
            if ("weight" in name.lower() and _is_quantized_dtype(t.dtype)) or (
                    name in params and t.dtype in FLOAT8):  # FP8 experts: gate_up_proj, down_proj
                full = f"{path}.{name}" if path else name
                raise refusal(action, f"{full!r} holds {t.dtype} values next to the scale tensor "
                              f"{scales[0]!r} (quantized weights)", fix)


def _check_fp8(path: str, module: nn.Module, pairs: list, action: str) -> None:
    """The FP8 ``pairs`` of ``module`` (``core.quant_layout.quant_pairs``: a block-scaled linear,
    or experts) as shardwise holds them: float8_e4m3fn values, float32 scales, dynamic activations."""
    for values, scales, block, scheme in pairs:
        if scheme != "fp8_block":
            continue
        v, s, linear = module._parameters[values], module._parameters[scales], len(block) == 2
        assert v is not None and s is not None  # quant_pairs lists present parameters only
        static = (getattr(module, "activation_scale", None) is not None if linear
                  else getattr(module, "activation_scheme", "dynamic") != "dynamic")
        problem = (f"its {values} is {v.dtype}" if v.dtype != torch.float8_e4m3fn
                   else f"its {scales} is {s.dtype} (ue8m0 scales?)" if s.dtype != torch.float32
                   else ("it has a static activation_scale" if linear else "it has static activation scales")
                   if static else None)
        if problem is not None:
            raise refusal(action, f"{'FP8 module' if linear else 'FP8 experts'} {path!r} "
                          f"({type(module).__name__}): {problem}",
                          f"shardwise supports {SUPPORTED_QUANT} with float8_e4m3fn weights, float32 scales "
                          "and dynamic activations; dequantize this checkpoint first")


def _is_quantized_dtype(dtype: torch.dtype) -> bool:
    return dtype in FLOAT8 or not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_mesh(mesh) -> None:
    """Raise ``MeshError`` if ``mesh`` is missing or spans more devices than the world (no
    collective)."""
    import torch.distributed as dist

    if mesh is None:
        raise MeshError("mesh is required; build one with sw.init_backend(...).mesh(tp=N)")
    if not dist.is_available() or not dist.is_initialized():
        raise MeshError("no process group is running; call sw.init_backend(...) before building the mesh")
    if is_spmd_mesh(mesh):  # an SPMD mesh counts devices, all driven by this process
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


__all__ = ["SUPPORTED_QUANT", "check_mesh", "check_model", "check_options", "quant_scheme", "refusal"]
