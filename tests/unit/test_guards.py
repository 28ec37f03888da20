"""Guards refuse unsupported models, meshes and options before any read or collective.

Single process on gloo (a world of one). Every collective of torch.distributed and every
region read is replaced by a trap, so a guard that ran after a collective or a read fails
the test; the control case shows a supported model loads under the same traps.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import safetensors.torch as st
import torch
from torch import nn

import shardwise as sw
from models import TinyTransformer, make_model, tiny_plan
from shardwise.errors import CheckpointError, MeshError, UnsupportedModelError
from shardwise.io import guards

COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "barrier", "gather", "scatter", "reduce",
    "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter", "all_to_all",
    "all_to_all_single", "all_gather_object", "broadcast_object_list", "gather_object",
    "scatter_object_list", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)


@pytest.fixture(scope="module")
def mesh():
    backend = sw.init_backend("gloo")
    yield backend.mesh(tp=1)
    sw.shutdown_backend()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("guards") / "model.safetensors"
    st.save_file(make_model().state_dict(), path)
    return path


@pytest.fixture
def traps(monkeypatch, mesh):
    """Make every collective and every file read raise; return what was attempted."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from shardwise.io.formats.safetensors import source as safetensors_source
    from shardwise.io.read import reader

    attempted: list[str] = []

    def trap(what):
        def fail(*args, **kwargs):
            attempted.append(what)
            raise AssertionError(f"{what} ran before a guard refused the model")
        return fail

    for name in COLLECTIVES:
        for module in (dist, c10d):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, trap(name))
    monkeypatch.setattr(reader, "read_region", trap("read_region"))
    monkeypatch.setattr(safetensors_source, "read_region", trap("read_region"))
    monkeypatch.setattr(os, "pread", trap("os.pread"))
    if hasattr(os, "preadv"):
        monkeypatch.setattr(os, "preadv", trap("os.preadv"))
    monkeypatch.setattr(safetensors_source, "resolve_checkpoint", trap("resolve_checkpoint"))
    return attempted


def meta_model() -> TinyTransformer:
    with torch.device("meta"):
        return TinyTransformer()


class AffineQuantizedTensor(torch.Tensor):
    pass


class Float8Tensor(torch.Tensor):
    pass


class Params4bit(nn.Parameter):
    pass


class Linear8bitLt(nn.Linear):
    pass


class AlignDevicesHook:
    pass


class LoraLayer(nn.Module):
    pass


class HookRegistry:  # diffusers' registry keeps hooks in a dict by name
    def __init__(self, *names):
        self.hooks = {n: object() for n in names}


def _subclass_param(cls):
    def mutate(m):
        with torch.device("meta"):
            t = torch.empty(32, 32).as_subclass(cls)
        m.layers[0].attn.q._parameters["weight"] = t
    return mutate


def _int8_with_scale(m):
    with torch.device("meta"):
        m.fused[0].mlp.down.weight = nn.Parameter(torch.empty(32, 64, dtype=torch.int8), requires_grad=False)
        m.fused[0].mlp.down.weight_scale = nn.Parameter(torch.empty(32))


def _fp8_experts(m):  # transformers' FP8Experts: fused 3-D fp8 experts with their scales
    with torch.device("meta"):
        m.fused[0].mlp.gate_up_proj = nn.Parameter(torch.empty(4, 64, 32, dtype=torch.float8_e4m3fn))
        m.fused[0].mlp.gate_up_proj_scale_inv = nn.Parameter(torch.empty(4, 1, 1))


def _fp8_linear(block_size):  # transformers' FP8Linear, block-scaled or (None) per-tensor
    def mutate(m):
        down = m.fused[0].mlp.down
        with torch.device("meta"):
            down.weight = nn.Parameter(torch.empty(down.weight.shape, dtype=torch.float8_e4m3fn))
            down.weight_scale_inv = nn.Parameter(torch.empty(()) if block_size is None else torch.empty(1, 1))
        down.block_size = block_size
    return mutate


def _setattr(path, attr, value):
    def mutate(m):
        setattr(m.get_submodule(path) if path else m, attr, value)
    return mutate


def _replace(path, factory):
    def mutate(m):
        parent, _, leaf = path.rpartition(".")
        setattr(m.get_submodule(parent), leaf, factory())
    return mutate


# (case, how to break a meta TinyTransformer, what the message must name)
MODEL_CASES = [
    ("torchao", _subclass_param(AffineQuantizedTensor),
     r"'layers\.0\.attn\.q\.weight'.*AffineQuantizedTensor"),
    ("float8", _subclass_param(Float8Tensor), r"quantized tensor subclass \(Float8Tensor\).*unquantized"),
    ("bnb_param", lambda m: m.head._parameters.__setitem__("weight", Params4bit(torch.empty(64, 32))),
     r"'head\.weight' is a bitsandbytes Params4bit"),
    ("bnb_module", _replace("layers.0.mlp.down", lambda: Linear8bitLt(64, 32, bias=False)),
     r"'layers\.0\.mlp\.down' is a quantized layer \(Linear8bitLt\)"),
    ("int_scale", _int8_with_scale, r"'fused\.0\.mlp\.down\.weight' holds torch\.int8.*'weight_scale'"),
    ("config", _setattr("", "config", SimpleNamespace(quantization_config={"quant_method": "bitsandbytes"})),
     r"quantized with 'bitsandbytes' \(model\.config\.quantization_config is set\).*FP8 with block scales"),
    *[(scheme, _setattr("", "config", SimpleNamespace(quantization_config={"quant_method": scheme})),
       rf"quantized with '{scheme}' \(model\.config\.quantization_config is set\)")
      for scheme in ("gptq", "awq", "compressed-tensors", "torchao")],
    ("fp8_per_tensor", _setattr("", "config", SimpleNamespace(quantization_config={
        "quant_method": "fp8", "weight_block_size": None})), r"quantized with 'fp8'.*per-tensor FP8 scales"),
    ("fp8_ue8m0", _setattr("", "config", SimpleNamespace(quantization_config={
        "quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"})),
     r"its scale_fmt is 'ue8m0'"),
    ("bnb_flag", _setattr("", "is_loaded_in_4bit", True),
     r"quantized with 'bitsandbytes' \(model\.is_loaded_in_4bit"),
    ("fp8_experts", _fp8_experts,
     r"'fused\.0\.mlp\.gate_up_proj' holds torch\.float8_e4m3fn.*'gate_up_proj_scale_inv'"),
    ("fp8_per_tensor_linear", _fp8_linear(None), r"'fused\.0\.mlp\.down\.weight' holds torch\.float8_e4m3fn"),
    ("hf_quantizer", _setattr("", "hf_quantizer", object()), r"model\.hf_quantizer is set"),
    ("device_map", _setattr("", "hf_device_map", {"": "cpu"}), r"hf_device_map.*without device_map"),
    ("hf_hook", _setattr("single.0.proj_in", "_hf_hook", AlignDevicesHook()),
     r"'single\.0\.proj_in' carries an accelerate hook \(AlignDevicesHook.*remove_hook_from_module"),
    ("group_offload", _setattr("layers.0", "_diffusers_hook", HookRegistry("group_offloading")),
     r"'layers\.0' is group-offloaded by diffusers.*turn group offloading off"),
    ("peft_config", _setattr("", "peft_config", {"default": object()}), r"PEFT adapters.*merge_and_unload"),
    ("lora_ab", _setattr("layers.0.attn.q", "lora_A", nn.ModuleDict()),
     r"'layers\.0\.attn\.q' has LoRA layers injected.*merge"),
    ("lora_class", _replace("layers.0.mlp", LoraLayer), r"'layers\.0\.mlp' is a PEFT layer \(LoraLayer\)"),
]


@pytest.mark.parametrize("mutate,message", [c[1:] for c in MODEL_CASES], ids=[c[0] for c in MODEL_CASES])
def test_model_guards(mutate, message, mesh, ckpt, traps):
    model = meta_model()
    mutate(model)
    with pytest.raises(UnsupportedModelError, match=message) as e:
        sw.load(model, ckpt, plan=tiny_plan(), mesh=mesh)
    assert str(e.value).startswith("cannot load this model")
    assert traps == []
    with pytest.raises(UnsupportedModelError, match=message) as e:
        guards.check_model(model, action="save")
    assert str(e.value).startswith("cannot save this model")


def test_harmless_lookalikes_pass():
    model = meta_model()
    model.layers[0]._diffusers_hook = HookRegistry("layerwise_casting")  # not an offload
    model.config = SimpleNamespace(quantization_config=None)
    with torch.device("meta"):  # integer buffer next to a float scale, no integer weight
        model.norm_out.register_buffer("position_ids", torch.arange(4))
        model.norm_out.register_buffer("scale", torch.ones(1))
    guards.check_model(model, action="load")


def test_fp8_block_scaled_passes():
    """FP8 with 128x128 block scales (DeepSeek-V3, Qwen3-FP8) is what shardwise supports."""
    model = meta_model()
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    model.config = SimpleNamespace(quantization_config=fp8)
    _fp8_linear([128, 128])(model)
    guards.check_model(model, action="load")
    guards.check_model(model, action="save")
    del model.fused[0].mlp.down.weight_scale_inv  # a dequantized model keeping the FP8 config: not saved
    model.fused[0].mlp.down.weight = nn.Parameter(torch.empty(32, 64, device="meta"))
    with pytest.raises(UnsupportedModelError, match=r"says fp8 but no module holds FP8 weights"):
        guards.check_model(model, action="save")


def test_mxfp4_passes():
    """MXFP4 (gpt-oss): uint8 x_blocks / x_scales pairs, as stored, under quant_method mxfp4."""
    model = meta_model()
    model.config = SimpleNamespace(quantization_config={"quant_method": "mxfp4"})
    mlp = model.fused[0].mlp
    with torch.device("meta"):
        mlp.w_blocks = nn.Parameter(torch.empty(4, 64, 1, 16, dtype=torch.uint8), requires_grad=False)
        mlp.w_scales = nn.Parameter(torch.empty(4, 64, 1, dtype=torch.uint8), requires_grad=False)
    guards.check_model(model, action="load")
    guards.check_model(model, action="save")
    del mlp.w_blocks, mlp.w_scales  # a dequantized model keeping the MXFP4 config: not saved
    with pytest.raises(UnsupportedModelError, match=r"says mxfp4 but no module holds MXFP4 weights"):
        guards.check_model(model, action="save")


class FakeMesh:
    """Duck-types what the guard reads; a real DeviceMesh cannot outgrow the world."""

    mesh_dim_names = ("tp",)
    ndim = 1

    def size(self):
        return 4


def test_mesh_larger_than_world(mesh, ckpt, traps):
    with pytest.raises(MeshError, match=r"mesh has 4 devices but the world has only 1.*--nproc-per-node 4"):
        sw.load(meta_model(), ckpt, plan=tiny_plan(), mesh=FakeMesh())
    assert traps == []


def test_options_that_cannot_stream(mesh, ckpt, traps):
    with pytest.raises(UnsupportedModelError, match=r"device_map='auto' cannot stream.*drop device_map"):
        sw.load(meta_model(), ckpt, plan=tiny_plan(), mesh=mesh, device_map="auto")
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        sw.load(meta_model(), ckpt, plan=tiny_plan(), mesh=mesh, colour="red")
    assert traps == []
    guards.check_options(device_map=None)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt"])
def test_pickle_weights_refused(name, mesh, tmp_path, monkeypatch):
    import torch.distributed as dist

    from shardwise.io.read import reader

    for n in COLLECTIVES:
        monkeypatch.setattr(dist, n, lambda *a, **k: pytest.fail("collective ran"), raising=False)
    monkeypatch.setattr(reader, "read_region", lambda *a, **k: pytest.fail("read a region"))
    (tmp_path / name).write_bytes(b"\x80\x04not really a pickle")
    for path in (tmp_path / name, tmp_path):
        with pytest.raises(CheckpointError, match=r"a pickle.*never unpickles.*save_file"):
            sw.load(meta_model(), path, plan=tiny_plan(), mesh=mesh)


def test_supported_model_loads_under_the_traps(mesh, ckpt, monkeypatch):
    """The control: with only the collectives trapped, a plain model loads (degree 1 needs none)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in COLLECTIVES:
        for module in (dist, c10d):
            monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("collective ran"), raising=False)
    model = meta_model()
    result = sw.load(model, ckpt, plan=tiny_plan(), mesh=mesh, progress=False)
    assert result.tensors == len(make_model().state_dict())
