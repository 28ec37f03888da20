"""The front door for Hugging Face models: ``sw.from_pretrained`` and ``sw.empty_model``, and a
hub repo id (``"org/name"``) as a checkpoint location. Imported on first use (it reaches the
whole load path); a model library only when its class is given."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from shardwise.comm import agree, all_gather_object
from shardwise.errors import CheckpointError, UnsupportedModelError, UsageError
from shardwise.hf.adapter import build_model, config_folder
from shardwise.hf.hub_layout import library_of
from shardwise.hf.pipeline import is_pipeline, load_pipeline
from shardwise.io.guards import check_mesh, quant_scheme
from shardwise.io.load import load
from shardwise.io.storage import Location, locate, split_scheme
from shardwise.mesh import world_backend
from shardwise.quant import drop_quantization_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from shardwise.backends import Backend

# The hub's repo ids: a namespace and a name, letters, digits, "-", "_", "." (no "--", "..")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


@contextlib.contextmanager
def empty_model():
    """Inside the block, each parameter registered becomes a meta tensor of its shape, dtype, class
    and ``requires_grad`` (one on meta is kept: ties stay); buffers are real (no checkpoint holds
    the non-persistent ones, a rotary ``inv_freq``).

    >>> with sw.empty_model():                                        # doctest: +SKIP
    ...     model = MyModel(config)
    >>> sw.load(model, "ckpt/", plan=plan, mesh=mesh)                 # doctest: +SKIP
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            if param.device.type != "meta":
                moved = type(param)(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
                moved.__dict__.update(param.__dict__)  # attributes libraries set on parameters
                param = moved
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
    """``"transformers"`` (a model or an Auto class) or ``"diffusers"``; else ``UnsupportedModelError``."""
    if not isinstance(cls, type):
        raise TypeError(f"sw.from_pretrained takes a model class (AutoModelForCausalLM, "
                        f"FluxTransformer2DModel, ...), got {type(cls).__name__} {cls!r:.80}")
    library = library_of(cls)
    if library is not None:
        return library
    if cls.__module__.startswith("transformers.models.auto") and hasattr(cls, "from_config"):
        return "transformers"
    raise UnsupportedModelError(
        f"{cls.__name__} is neither a transformers model class (PreTrainedModel or an Auto class) "
        "nor a diffusers ModelMixin; build the model inside `with sw.empty_model():` and call "
        "sw.load(model, path, plan=..., mesh=...)")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None):
    """Parameters and float buffers created without a dtype get ``dtype``, as the libraries'
    own ``from_pretrained(dtype=...)`` builds them."""
    before = torch.get_default_dtype()
    if dtype is not None and dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _build(cls, library: str, folder: Path, dtype: torch.dtype | None, dequantize: bool) -> nn.Module:
    model: Any = build_model(cls, folder, **({"dtype": dtype} if dtype is not None else {}))  # a library's
    if library == "diffusers":
        return model
    import transformers

    generation = folder / "generation_config.json"
    if generation.is_file() and getattr(model, "can_generate", lambda: False)():
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    # A quantization shardwise reads (FP8 block scales, MXFP4) gets transformers' own quantized
    # modules, put in place by its quantizer (dequantize: none); any other is left to the load's
    # guards, which refuse it naming the scheme.
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    method = quant_scheme(qc)
    if qc is None or method[1] is not None:
        return model
    if dequantize:
        drop_quantization_config(model)
        return model
    from transformers.quantizers import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(qc, pre_quantized=True)
    if method[0] == "mxfp4":
        mxfp4_experts(model, quantizer)
    else:
        quantizer.preprocess_model(model)
    return model


def mxfp4_experts(model: nn.Module, quantizer=None) -> nn.Module:
    """Put transformers' MXFP4 expert modules (``Mxfp4GptOssMLP`` / ``Mxfp4GptOssExperts``) on
    meta in place of a gpt-oss model's MLPs, where its quantizer would (``modules_to_not_convert``
    from ``quantizer``, else the config's ``quantization_config``); return the model.

    Not through ``replace_with_mxfp4_linear``: without a GPU it leaves the model unquantized,
    elsewhere it fetches Triton kernels from the hub. Each experts module holds the tensors as
    stored (uint8 ``*_blocks`` ``(E, rows, K/32, 16)`` and ``*_scales`` ``(E, rows, K/32)``, its
    quantizer's ``serialized_names``), so a rank's shards are what ``swizzle_mxfp4_convertops``
    takes and ``sw.save`` writes them back as stored; biases keep the checkpoint's dtype.
    """
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


def from_pretrained(cls, path: str | os.PathLike, *, mesh, dtype: torch.dtype | None = None,
                    plan="auto", dequantize: bool = False, revision: str | None = None,
                    token: str | bool | None = None, storage_options: dict | None = None,
                    **load_options) -> nn.Module:
    """``cls`` (a transformers model or Auto class, or a diffusers ``ModelMixin`` class) built from
    ``path``'s config inside :func:`empty_model`, then ``sw.load(model, path, plan=plan, mesh=mesh,
    dtype=dtype, dequantize=dequantize, **load_options)``. ``dtype``: floating-point tensors (None:
    the checkpoint's). FP8 / MXFP4 checkpoints get transformers' quantized modules and stay
    quantized, unless ``dequantize=True`` (then no ``quantization_config``).

    ``path``: a folder, a URL (``storage_options``) or a hub repo id ``"org/name"`` (no local path
    of that name) at ``revision`` (default ``"main"``, one commit on every rank) with ``token``
    (else ``HF_TOKEN``). Collective over the mesh. Returns the model in eval mode, the load's
    result as ``model.result``; raises ``UsageError``, ``CheckpointError``, ``UnsupportedModelError``.

    >>> model = sw.from_pretrained(AutoModelForCausalLM, "ckpt/", mesh=backend.mesh(tp=4))  # doctest: +SKIP
    >>> model.result                                                                 # doctest: +SKIP
    LoadResult(tensors=291, bytes_read=4021813248, seconds=1.912, missing=0, unexpected=0)
    """
    if isinstance(cls, type) and is_pipeline(cls):  # every component, the sharded ones through here
        check_mesh(mesh)
        if plan != "auto":
            raise UsageError("a pipeline takes each component's own plan: drop plan= (or load a component "
                             "yourself and pass it: transformer=...)")
        where = where_named(path, revision, token, storage_options, world_backend())
        return load_pipeline(cls, where, mesh=mesh, load_model=from_pretrained, dtype=dtype,
                             dequantize=dequantize, **load_options)
    library = _library(cls)
    check_mesh(mesh)  # before anything is read or built
    folder = where_named(path, revision, token, storage_options, world_backend())
    if not folder.is_folder():
        raise CheckpointError(
            f"{folder}: no such folder; sw.from_pretrained reads a checkpoint folder (config.json and "
            "safetensors), local or at a URL, or a hub repo id 'org/name'")
    if (folder / "config.json").stat() is None:
        raise CheckpointError(
            f"{folder}: no config.json, so the model cannot be built from this folder; pass the "
            "folder save_pretrained (or sw.save of a Hugging Face model) wrote, e.g. "
            "'ckpt/transformer' for a diffusers pipeline's transformer")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    with _default_dtype(dtype), empty_model(), config_folder(folder) as configs:
        model = _build(cls, library, configs, dtype, dequantize)
    result = load(model, folder, plan=plan, mesh=mesh, dtype=dtype, dequantize=dequantize, **load_options)
    model.eval()
    if "result" in model._modules or "result" in model._parameters or "result" in model._buffers:
        raise UnsupportedModelError(f"{type(model).__name__} has a submodule or tensor named 'result', "
                                    "where sw.from_pretrained puts the load result")
    model.__dict__["result"] = result
    return model


def where_named(path, revision: str | None, token: str | bool | None, storage_options: dict | None,
           backend) -> Location:
    """The folder ``path`` names: a hub repo id's (:func:`hub_location`, agreed over ``backend``),
    a URL's or a local one."""
    if is_repo_id(path):
        return hub_location(cast(str, path), revision=revision, token=token,
                            storage_options=storage_options, backend=backend)
    if revision is not None or token is not None:
        raise UsageError(f"revision= and token= go with a hub repo id ('org/name'); {os.fspath(path)!r} is "
                         "a local path or a URL (an hf:// URL names its revision: hf://org/name@rev)")
    return locate(path, storage_options)


def is_repo_id(path) -> bool:
    """Whether ``path`` names a hub repo: ``"org/name"``, no scheme, and no local path of that name."""
    return (isinstance(path, str) and split_scheme(path)[0] is None and _REPO_ID.fullmatch(path) is not None
            and "--" not in path and ".." not in path and not os.path.exists(path))


def hub_location(repo_id: str, *, revision: str | None, token: str | bool | None,
                 storage_options: dict | None, backend: Backend | None) -> Location:
    """The ``hf://{repo_id}@{commit}`` location of ``repo_id`` at ``revision`` (default ``"main"``):
    read in place by ranged GETs (fsspec's ``hf://``), nothing downloaded whole; with
    ``HF_HUB_OFFLINE`` set, the snapshot folder of the local hub cache. Collective over
    ``backend`` (None: one process): every rank resolves the commit and the ranks compare, so all
    read one commit. ``CheckpointError`` on every rank for an unknown repo or revision, one the
    token cannot see, or a hub that cannot be reached; no token is shown."""
    revision = revision or "main"
    commit, error, cached = None, None, None
    try:
        if _offline():  # HF_HUB_OFFLINE: the snapshot in the local hub cache, read in place
            cached = _cached(repo_id, revision, token)
            commit = cached.name
        else:
            commit = _commit(repo_id, revision, token)
    except CheckpointError as e:
        error = e
    agree(backend, error, what=f"resolving the hub repo {repo_id!r} at {revision!r}")
    commits = set(all_gather_object(commit, purpose="the hub commit")) if backend is not None else {commit}
    if len(commits) > 1:
        raise CheckpointError(f"{repo_id!r}: the revision {revision!r} moved while the ranks resolved it "
                              f"(commits {sorted(c for c in commits if c)}); pass revision=<a commit sha>")
    if cached is not None:
        if storage_options:
            raise UsageError(f"{repo_id!r} is read from the local hub cache (HF_HUB_OFFLINE): drop "
                             "storage_options")
        return locate(cached)
    options = dict(storage_options or {})
    if token is not None:
        options["token"] = token
    return locate(f"hf://{repo_id}@{commit}", options)


def _offline() -> bool:
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)


def _cached(repo_id: str, revision: str, token: str | bool | None) -> Path:
    """The snapshot folder of ``repo_id`` at ``revision`` in the local hub cache (its name is
    the commit); ``CheckpointError`` when the cache has none."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, token=token, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - LocalEntryNotFoundError and its kin, across versions
        raise CheckpointError(f"{repo_id!r}: HF_HUB_OFFLINE is set and the local hub cache holds no snapshot "
                              f"of it at {revision!r} ({type(e).__name__}); download it while online "
                              "(huggingface_hub.snapshot_download), or pass the folder") from None


def _commit(repo_id: str, revision: str, token: str | bool | None) -> str:
    try:
        from huggingface_hub import HfApi, constants
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
    except ImportError as e:
        raise UsageError(f"{repo_id!r} is read as a hub repo id, which needs huggingface_hub: "
                         "pip install huggingface_hub") from e
    where = f"{constants.ENDPOINT}"
    try:
        info = HfApi(token=token).model_info(repo_id, revision=revision)
    except RevisionNotFoundError:
        raise CheckpointError(f"the hub repo {repo_id!r} ({where}) has no revision {revision!r}; pass an "
                              "existing branch, tag or commit sha as revision=") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo_id!r}: no local folder of that name, and no model repo {repo_id!r} on "
                              f"{where} that this token can see; check the id, or pass token= (or set "
                              "HF_TOKEN) for a private or gated repo") from None
    except Exception as e:  # a token refused; offline mode, a connection refused, a 5xx
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise CheckpointError(f"{where} refused access to the hub repo {repo_id!r} (HTTP {status}): "
                                  "pass token= (or set HF_TOKEN) with read access to it") from None
        raise CheckpointError(f"{repo_id!r}: no local folder of that name, and as a hub repo id (revision "
                              f"{revision!r}) {where} could not serve it: {type(e).__name__}: "
                              f"{_scrub(e, token)}; offline, pass the downloaded folder instead") from None
    if not info.sha:
        raise CheckpointError(f"{where} gave no commit for {repo_id!r} at {revision!r}")
    return info.sha


def _scrub(error: Exception, token: str | bool | None) -> str:
    text = (str(error).strip().splitlines() or [""])[0]
    for secret in (token, os.environ.get("HF_TOKEN")):
        if isinstance(secret, str) and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


__all__ = ["empty_model", "from_pretrained", "hub_location", "is_repo_id", "mxfp4_experts", "where_named"]
