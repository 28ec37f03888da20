"""safetensors 0.8's F4 (torch.float4_e2m1fn_x2) and F8_E8M0 (torch.float8_e8m0fnu) dtypes.

An F4 header counts FP4 values (two a byte along the last dim); torch and every region in
shardwise count bytes, so a header's ``[.., 2n]`` is a tensor's ``(.., n)``: headers convert at
the two ends (parse, layout), and a slice is always whole bytes. Here a gpt-oss style MXFP4
tensor in the new dtypes (``*_blocks`` F4 ``(E, rows, K/32, 32 values)``, ``*_scales`` F8_E8M0
``(E, rows, K/32)``) is loaded on spawned gloo ranks at tp 2 and 4, each rank checked against
the stored bytes of its slice, and written back by ``sw.save``: the file equals
``safetensors.torch.save_file``'s byte for byte. On a torch older than these dtypes (2.6, the
floor) the file is refused naming the torch that reads it.
"""

from __future__ import annotations

import json
import struct

import pytest
import safetensors
import safetensors.torch as st
import torch
from torch import nn

import shardwise as sw
from harness import run_ranks
from shardwise.core import header as H
from shardwise.core.quant import mxfp4_dequantize_region
from shardwise.core.spec import Region
from shardwise.errors import CheckpointError

F4 = getattr(torch, "float4_e2m1fn_x2", None)
E8M0 = getattr(torch, "float8_e8m0fnu", None)
new_dtypes = pytest.mark.skipif(
    F4 is None or E8M0 is None or tuple(map(int, safetensors.__version__.split(".")[:2])) < (0, 8),
    reason=f"needs torch >= 2.8 and safetensors >= 0.8 (torch {torch.__version__}, safetensors "
           f"{safetensors.__version__}); test_a_torch_without_the_dtype_names_the_fix covers older ones")
E, ROWS, GROUPS = 4, 8, 4  # K = 128 values: 4 groups of 32, one a rank at tp 4
BLOCKS, SCALES = "experts.gate_up_proj_blocks", "experts.gate_up_proj_scales"


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        blocks, scales = torch.empty(E, ROWS, GROUPS, 16, dtype=F4), torch.empty(E, ROWS, GROUPS, dtype=E8M0)
        self.gate_up_proj_blocks = nn.Parameter(blocks, requires_grad=False)
        self.gate_up_proj_scales = nn.Parameter(scales, requires_grad=False)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = Experts()
        self.proj = nn.Linear(16, 8, bias=False)


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (E, ROWS, GROUPS, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (E, ROWS, GROUPS), generator=gen, dtype=torch.uint8)
    return {BLOCKS: raw.view(F4), SCALES: scales.view(E8M0), "proj.weight": torch.randn(8, 16, generator=gen)}


def _file_header(path) -> dict:
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n])


@new_dtypes
def test_the_header_counts_values_and_matches_safetensors(tmp_path):
    path = tmp_path / "m.safetensors"
    st.save_file(tensors(), path)
    header = _file_header(path)
    assert header[BLOCKS]["dtype"] == "F4" and header[BLOCKS]["shape"] == [E, ROWS, GROUPS, 32]
    assert header[SCALES]["dtype"] == "F8_E8M0"
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    parsed = H.parse_header(data[8:8 + n], data_size=len(data) - 8 - n, source="m")
    entry = parsed.entries[BLOCKS]
    assert (entry.shape, entry.torch_dtype) == ((E, ROWS, GROUPS, 16), F4)
    assert entry.nbytes == E * ROWS * GROUPS * 16
    assert H.dtype_to_str(F4) == "F4" and H.dtype_to_str(E8M0) == "F8_E8M0"
    # layout_header writes back what safetensors wrote, in the same order
    entries = sorted(parsed.entries.values(), key=lambda e: e.start)
    specs = [(e.name, e.dtype, e.shape) for e in entries]
    prefix, _ = H.layout_header(specs, parsed.metadata)
    assert data.startswith(prefix)


def test_an_odd_f4_last_dim_is_refused_naming_the_fix():
    raw = json.dumps({"w": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}).encode()
    if F4 is None:
        with pytest.raises(CheckpointError, match="needs torch >= 2.8"):
            H.parse_header(raw, data_size=3, source="odd")
        return
    with pytest.raises(CheckpointError, match="last dim that is not a multiple of 2.*even last dim"):
        H.parse_header(raw, data_size=3, source="odd")
    assert H.stored_shape("F4", (4, 6)) == (4, 12) and H.torch_shape("F4", (4, 12), where="x") == (4, 6)


def test_a_torch_without_the_dtype_names_the_fix(monkeypatch):
    monkeypatch.delitem(H._STR_TO_DTYPE, "F8_E8M0", raising=False)
    raw = json.dumps({"s": {"dtype": "F8_E8M0", "shape": [4], "data_offsets": [0, 4]}}).encode()
    with pytest.raises(CheckpointError, match=r"'F8_E8M0' \(torch.float8_e8m0fnu\) needs torch >= 2.7.*upgr"):
        H.parse_header(raw, data_size=4, source="scales")


@new_dtypes
def test_f4_blocks_dequantize_as_their_u8_bytes():
    t = tensors()
    region = Region((0, 0, 0), (E, ROWS, GROUPS * 32))
    as_f4 = mxfp4_dequantize_region(t[BLOCKS], t[SCALES], region, torch.float32)
    u8 = torch.uint8
    as_u8 = mxfp4_dequantize_region(t[BLOCKS].view(u8), t[SCALES].view(u8), region, torch.float32)
    assert torch.equal(as_f4, as_u8) and as_f4.abs().sum() > 0


def _load_and_save(path, tp, out):
    from shardwise.parallel import local_of

    backend = sw.init_backend("gloo")
    with torch.device("meta"):
        model = Model()
    # the MXFP4 key names the logical weight (E, ROWS, K): colwise cuts K into whole groups
    plan = {"experts.gate_up_proj": "colwise", "proj": "colwise"}
    sw.load(model, path, plan=plan, mesh=backend.mesh(tp=tp))
    held = {n: local_of(p) for n, p in model.named_parameters()}
    sw.save(model, out, overwrite=True)
    # bytes, not tensors: a tensor result goes back through shared memory, which the exited rank took along
    return {n: (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
            for n, t in held.items()}


@new_dtypes
@pytest.mark.parametrize("tp", [2, 4])
def test_mxfp4_in_f4_and_e8m0_round_trips_through_tp(tmp_path, tp):
    source = tmp_path / "ckpt" / "model.safetensors"
    source.parent.mkdir()
    canonical = tensors()
    st.save_file(canonical, source, metadata={"format": "pt"})  # as save_pretrained and sw.save
    out = tmp_path / "saved"
    results = run_ranks(_load_and_save, tp, str(source), tp, str(out), timeout=240)
    per = GROUPS // tp
    for rank, held in enumerate(results):
        dtype, shape, got = held[BLOCKS]
        assert (dtype, shape) == (str(F4), (E, ROWS, per, 16))
        want = canonical[BLOCKS].view(torch.uint8)[:, :, rank * per:(rank + 1) * per].contiguous()
        assert got == want.numpy().tobytes(), f"rank {rank}: F4 blocks are not the stored bytes of its groups"
        dtype, shape, got = held[SCALES]
        assert (dtype, shape) == (str(E8M0), (E, ROWS, per))
        want = canonical[SCALES].view(torch.uint8)[:, :, rank * per:(rank + 1) * per].contiguous()
        assert got == want.numpy().tobytes(), f"rank {rank}: E8M0 scales are not its groups' stored bytes"
    saved = sorted(out.glob("*.safetensors"))
    assert len(saved) == 1
    assert saved[0].read_bytes() == source.read_bytes(), "sw.save did not write F4/E8M0 back byte for byte"
