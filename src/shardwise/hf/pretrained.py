"""The front door for Hugging Face models: ``sw.from_pretrained`` and ``sw.empty_model``.

``from_pretrained`` does what a transformers or diffusers ``from_pretrained`` does up to the
weights (read the config, build the model), but builds it with its parameters on the meta
device and its buffers real, then streams each rank's slice with ``sw.load``. Neither
library is imported by ``import shardwise``: only when this module's functions are called,
and only the one the class comes from.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from shardwise.errors import CheckpointError, UnsupportedModelError, UsageError
from shardwise.hf.files import config_folder
from shardwise.hf.repo import hub_location, is_repo_id
from shardwise.io.guards import check_mesh, quant_scheme
from shardwise.io.load import load
from shardwise.io.storage import Location, locate
from shardwise.mesh import world_backend
from shardwise.quant import drop_quantization_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@contextlib.contextmanager
def empty_model():
    """Build models with parameters on the meta device and buffers real, ties kept.

    Inside the block every parameter a module registers is replaced by a meta tensor of the
    same shape, dtype, class and ``requires_grad``; buffers (a rotary ``inv_freq``, position
    ids) are computed on the CPU as usual, since no checkpoint stores the non-persistent
    ones. A parameter that is already on meta is registered as it is, so a weight tied in
    ``__init__`` (``lm_head.weight = embed.weight``) stays one tensor. Each parameter is
    created as its module creates it (for ``nn.Linear`` and ``nn.Embedding`` an untouched
    ``torch.empty``) and dropped at once; the modules' initialisers then run on the meta
    tensor, and transformers' ones skip it (it is flagged ``_is_hf_initialized``).

    >>> with sw.empty_model():                                        # doctest: +SKIP
    ...     model = MyModel(config)
    >>> sw.load(model, "ckpt/", plan=plan, mesh=mesh)                 # doctest: +SKIP
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            moved = type(param)(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)  # attributes libraries set on parameters
            param = moved
        if param is not None:
            # transformers' weight initialisers skip a tensor flagged as initialised; on meta
            # they would only cost time (torch runs meta normal_ through Python decompositions,
            # ~0.5 ms a call). Its buffer initialisers (rotary tables) still run.
            param._is_hf_initialized = True  # type: ignore[attr-defined]  # transformers' own flag
        original(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _library(cls) -> str:
    """``"transformers"`` or ``"diffusers"``, from the class hierarchy (no import needed)."""
    if not isinstance(cls, type):
        raise TypeError(f"sw.from_pretrained takes a model class (AutoModelForCausalLM, "
                        f"FluxTransformer2DModel, ...), got {type(cls).__name__} {cls!r:.80}")
    bases = {(c.__module__.split(".")[0], c.__name__) for c in cls.__mro__}
    if ("transformers", "PreTrainedModel") in bases or (
            cls.__module__.startswith("transformers.models.auto") and hasattr(cls, "from_config")):
        return "transformers"
    if ("diffusers", "ModelMixin") in bases:
        return "diffusers"
    if ("diffusers", "DiffusionPipeline") in bases:
        raise UnsupportedModelError(
            f"{cls.__name__} is a diffusers pipeline; sw.from_pretrained loads one model: pass its "
            "class and folder, e.g. sw.from_pretrained(FluxTransformer2DModel, 'ckpt/transformer', "
            "mesh=mesh), then build the pipeline around it")
    raise UnsupportedModelError(
        f"{cls.__name__} is neither a transformers model class (PreTrainedModel or an Auto class) "
        "nor a diffusers ModelMixin; build the model inside `with sw.empty_model():` and call "
        "sw.load(model, path, plan=..., mesh=...)")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None):
    """Parameters and float buffers created without a dtype get ``dtype``, as the libraries'
    own ``from_pretrained(dtype=...)`` builds them."""
    if dtype is None or not dtype.is_floating_point:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _build_transformers(cls, folder: Path, dtype: torch.dtype | None) -> nn.Module:
    import transformers

    auto = cls.__module__.startswith("transformers.models.auto")
    config_cls = getattr(cls, "config_class", None) if not auto else None
    config = (config_cls or transformers.AutoConfig).from_pretrained(folder)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = cls.from_config(config, **kwargs) if auto else cls._from_config(config, **kwargs)
    generation = folder / "generation_config.json"
    if generation.is_file() and getattr(model, "can_generate", lambda: False)():
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    return model


def _quantized_modules(model: nn.Module, dequantize: bool) -> None:
    """A checkpoint whose config has a quantization shardwise reads (FP8 with block scales,
    MXFP4) gets transformers' own quantized modules, put in place by its quantizer as its
    ``from_pretrained`` does (``modules_to_not_convert``, lm_head left whole); with
    ``dequantize`` the model stays unquantized. Any other quantization is left to the load's
    guards, which refuse it naming the scheme."""
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    method = quant_scheme(qc)
    if qc is None or method[1] is not None:
        return
    if dequantize:
        drop_quantization_config(model)
        return
    from transformers.quantizers import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(qc, pre_quantized=True)
    if method[0] == "mxfp4":
        mxfp4_experts(model, quantizer)
    else:
        quantizer.preprocess_model(model)


def mxfp4_experts(model: nn.Module, quantizer=None) -> nn.Module:
    """Put transformers' MXFP4 expert modules (``Mxfp4GptOssMLP`` / ``Mxfp4GptOssExperts``) in
    place of a gpt-oss model's MLPs, on the meta device, where its quantizer's
    ``replace_with_mxfp4_linear`` puts them (``modules_to_not_convert`` from ``quantizer``, else
    the model config's ``quantization_config``), and return the model.

    Not through that function: on a machine without a GPU it leaves the model unquantized, and
    elsewhere it first fetches its Triton kernels from the hub. And each experts module holds
    the checkpoint's tensors as they are stored, ``gate_up_proj_blocks`` / ``down_proj_blocks``
    (uint8 ``(E, rows, K/32, 16)``) and ``*_scales`` (uint8 ``(E, rows, K/32)``), the names of its
    quantizer's ``serialized_names``, as uint8 parameters, in place of its packed placeholder
    ``gate_up_proj`` that transformers replaces at load by a Triton tensor: a rank's shards are
    what ``transformers.integrations.mxfp4.swizzle_mxfp4_convertops(blocks, scales, ...)``
    takes, and ``sw.save`` writes them back as stored. The biases keep the dtype of the
    module they replace (the checkpoint's), so a save writes them back as stored too.
    """
    import torch
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts, Mxfp4GptOssMLP
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.quantizers import AutoHfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    hf_model = cast("PreTrainedModel", model)  # a gpt-oss model
    if quantizer is None:
        quantizer = AutoHfQuantizer.from_config(hf_model.config.quantization_config, pre_quantized=True)
    skip = quantizer.get_modules_to_not_convert(
        hf_model, quantizer.quantization_config.modules_to_not_convert, hf_model._keep_in_fp32_modules)
    for name, module in list(model.named_modules()):
        if not (isinstance(module, GptOssMLP) and should_convert_module(f"{name}.experts", skip)):
            continue
        with torch.device("meta"):
            experts = Mxfp4GptOssExperts(hf_model.config)
        held = {}  # in the module's order, each placeholder replaced where it stood
        for pname, param in experts._parameters.items():
            p: torch.Tensor | None = param
            if pname.endswith("_bias"):
                p = torch.empty_like(getattr(module.experts, pname), device="meta")
            assert p is not None  # every placeholder of Mxfp4GptOssExperts is a tensor
            if p.dtype == torch.uint8:  # (E, rows, K / 2) bytes
                groups = tuple(p.shape[:-1]) + (p.shape[-1] // 16,)
                held[pname + "_blocks"] = torch.empty(groups + (16,), dtype=torch.uint8, device="meta")
                held[pname + "_scales"] = torch.empty(groups, dtype=torch.uint8, device="meta")
            else:
                held[pname] = p
        experts._parameters.clear()
        for pname, p in held.items():
            experts.register_parameter(pname, nn.Parameter(p, requires_grad=False))
        model.set_submodule(name, Mxfp4GptOssMLP(module.router, experts))
    model.is_quantized = True  # type: ignore[assignment]  # stubs: Module attrs are Tensor | Module
    model.quantization_method = quantizer.quantization_config.quant_method
    return model


def _build_diffusers(cls, folder: Path) -> nn.Module:
    return cls.from_config(cls.load_config(folder))


def _checkpoint_folder(folder: Location) -> Location:
    if not folder.is_folder():
        raise CheckpointError(
            f"{folder}: no such folder; sw.from_pretrained reads a checkpoint folder (config.json and "
            "safetensors), local or at a URL, or a hub repo id 'org/name'")
    if (folder / "config.json").stat() is None:
        raise CheckpointError(
            f"{folder}: no config.json, so the model cannot be built from this folder; pass the "
            "folder save_pretrained (or sw.save of a Hugging Face model) wrote, e.g. "
            "'ckpt/transformer' for a diffusers pipeline's transformer")
    return folder


def from_pretrained(cls, path: str | os.PathLike, *, mesh, dtype: torch.dtype | None = None,
                    plan="auto", dequantize: bool = False, revision: str | None = None,
                    token: str | bool | None = None, storage_options: dict | None = None,
                    **load_options) -> nn.Module:
    """A transformers or diffusers model read from the folder ``path``, sharded over ``mesh``.

    ``cls`` is a transformers model class or Auto class (``AutoModelForCausalLM``) or a
    diffusers ``ModelMixin`` class (``FluxTransformer2DModel``). The config is read from
    ``path``, the model built inside :func:`empty_model` (parameters on meta, buffers real),
    then every rank streams its own slice with ``sw.load(model, path, plan=plan, mesh=mesh,
    dtype=dtype, **load_options)``. ``plan="auto"`` is the model's own plan (transformers:
    the config's ``base_model_tp_plan`` under the base model's prefix plus the class's
    ``_tp_plan``; diffusers: the class's ``_tp_plan``); a dict replaces it. ``dtype`` builds
    and casts floating-point tensors to it (``None`` keeps the checkpoint's dtypes).
    Collective like ``sw.load``: every rank of the mesh calls it.

    An FP8 checkpoint (``quantization_config`` with ``quant_method: fp8`` and block scales in
    its config.json) is built with transformers' own ``FP8Linear`` modules (its quantizer's
    module replacement) and stays quantized: each rank holds its fp8 weight shards and the
    scales of the blocks they touch (``dtype`` applies to the other tensors). An MXFP4
    checkpoint (gpt-oss) is built with transformers' MXFP4 expert modules
    (:func:`mxfp4_experts`), each rank holding its experts' ``*_blocks`` and ``*_scales`` as
    stored (all of them under the tp plan, which leaves experts whole; its own under the ep
    plan). With ``dequantize=True`` the model is built unquantized, each rank dequantizes only
    its own shards into ``dtype``, and the config loses its ``quantization_config``, as
    transformers' ``FineGrainedFP8Config(dequantize=True)`` / ``Mxfp4Config(dequantize=True)`` do.

    ``path`` may be a URL (``s3://``, ``gs://``, any fsspec URL), its storage given
    ``storage_options``, or a Hugging Face hub repo id ``"org/name"`` (when no local path has
    that name) at ``revision`` (a branch, tag or commit; default ``"main"``) with ``token`` (else
    ``HF_TOKEN``), from ``HF_ENDPOINT``: the revision is pinned to one commit on every rank and
    each rank reads only its own byte ranges of the repo's files (``shardwise.hf.repo``).
    Returns the model in eval mode, with the ``sw.load`` result as ``model.result``.

    >>> from transformers import AutoModelForCausalLM                                # doctest: +SKIP
    >>> model = sw.from_pretrained(AutoModelForCausalLM, "ckpt/", mesh=backend.mesh(tp=4))  # doctest: +SKIP
    >>> model = sw.from_pretrained(AutoModelForCausalLM, "org/name", mesh=mesh)  # doctest: +SKIP
    >>> model.result                                                                 # doctest: +SKIP
    LoadResult(tensors=291, bytes_read=4021813248, seconds=1.912, missing=0, unexpected=0)
    """
    library = _library(cls)
    check_mesh(mesh)  # before anything is read or built
    if is_repo_id(path):
        where = hub_location(cast(str, path), revision=revision, token=token, storage_options=storage_options,
                             backend=world_backend())
    elif revision is not None or token is not None:
        raise UsageError(f"revision= and token= go with a hub repo id ('org/name'); {os.fspath(path)!r} is "
                         "a local path or a URL (an hf:// URL names its revision: hf://org/name@rev)")
    else:
        where = locate(path, storage_options)
    folder = _checkpoint_folder(where)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    with _default_dtype(dtype), empty_model(), config_folder(folder) as configs:
        model = (_build_transformers(cls, configs, dtype) if library == "transformers"
                 else _build_diffusers(cls, configs))
        if library == "transformers":
            _quantized_modules(model, dequantize)
    result = load(model, folder, plan=plan, mesh=mesh, dtype=dtype, dequantize=dequantize, **load_options)
    model.eval()
    _attach(model, "result", result)
    return model


def _attach(model: nn.Module, name: str, value) -> None:
    if name in model._modules or name in model._parameters or name in model._buffers:
        raise UnsupportedModelError(f"{type(model).__name__} has a submodule or tensor named {name!r}, "
                                    "where sw.from_pretrained puts the load result")
    model.__dict__[name] = value


__all__ = ["empty_model", "from_pretrained", "mxfp4_experts"]
