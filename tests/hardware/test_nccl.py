"""The nccl suite (``tox -e nccl``, ``backends/nccl/validate.sh``): CUDA GPUs joined by NCCL,
one spawned rank per GPU present (a world of one on one GPU).

Checks: the pinned host staging of the load path (byte-exact, every dtype, tensors larger
than a staging buffer, concurrent callers); streaming load at degree = world with each local
shard byte-equal to its slice and ``bytes_read`` equal to the rank's regions; the forward
against the one-process CPU forward; a gather save byte-equal to the canonical tensors; a DCP
save loaded back at another layout. Each check prints a ``shardwise nccl:`` line (run pytest
with ``-s`` to see them; validate.sh collects them).
"""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.parallel import get_shard_state

pytestmark = [
    pytest.mark.nccl,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs CUDA GPUs: torch.cuda.is_available() is False here"),
]

TOLERANCE = 1e-4  # fp32 on the GPU vs the CPU: summation order only (TF32 stays off for matmuls)


def _world() -> int:
    return torch.cuda.device_count()


def _say(text: str) -> None:
    print(f"shardwise nccl: {text}", flush=True)


def _layouts(world: int) -> tuple[dict, dict]:
    """(the layout to save from, another layout to load the DCP checkpoint at)."""
    if world % 2 == 0:
        return {"tp": world}, {"dp_shard": 2, "tp": world // 2}
    return {"tp": world}, {"tp": world}


def test_pinned_staging_is_byte_exact():
    from shardwise.io.staging import PinnedStager, host_to_device

    device = torch.device("cuda", 0)
    assert isinstance(host_to_device(device), PinnedStager)
    stage = PinnedStager(device, buffer_bytes=1000, num_buffers=2)  # small: many pieces, reuse
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(37, 29, generator=g), torch.randn(5000, generator=g).to(torch.bfloat16),
               torch.randint(0, 2, (999,), generator=g).bool(), torch.tensor(3.5, dtype=torch.float64),
               torch.empty(0, 4), torch.randint(-9, 9, (3, 70, 11), generator=g).to(torch.int8),
               torch.randn(64, 64, generator=g)[:, ::2]]  # non-contiguous
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:  # the reader's threads call it at once
        moved = list(pool.map(stage, tensors * 3))
    stage.join()  # the side stream's copies, before the current stream reads them
    for src, dst in zip(tensors * 3, moved, strict=True):
        assert dst.device == device and dst.dtype == src.dtype and dst.shape == src.shape
        back = dst.cpu()
        assert torch.equal(back.contiguous().reshape(-1).view(torch.uint8),  # 0-dim and strided too
                           src.contiguous().reshape(-1).view(torch.uint8))
    assert stage._made <= 2
    _say(f"pinned staging: {len(moved)} tensors through 2 buffers of 1000 B, byte-exact")


def _ranks(ckpt: str, out: str):
    import safetensors.torch as st

    import shardwise as sw
    from models import TinyTransformer, make_model, tiny_plan, tokens
    from shardwise.core.spec import shard_regions, split
    from shardwise.parallel import local_of

    backend = sw.init_backend("nccl")
    world, rank = backend.world_size, backend.rank
    assert backend.device == torch.device("cuda", rank)
    canonical = st.load_file(f"{ckpt}/model.safetensors")
    reference = make_model()(tokens()).detach()
    save_at, load_at = _layouts(world)
    report = {}

    def fresh():
        with torch.device("meta"):
            return TinyTransformer()

    def check_shards(model):
        state = get_shard_state(model)
        for name, spec in state.specs.items():
            want = canonical[name] if spec.replicated else split(canonical[name], spec, state.degree,
                                                                 state.tp_rank)
            got = local_of(model.state_dict()[name])
            assert got.device == backend.device, name
            assert torch.equal(got.cpu().view(torch.uint8), want.contiguous().view(torch.uint8)), name
        return state

    model = fresh()
    result = sw.load(model, ckpt, plan=tiny_plan(), mesh=backend.mesh(**save_at))
    state = check_shards(model)
    regions = sum(math.prod(r.sizes) * canonical[n].element_size() for n, spec in state.specs.items()
                  for r in shard_regions(canonical[n].shape, spec, state.degree, state.tp_rank))
    assert result.bytes_read == regions, (result.bytes_read, regions)
    with torch.no_grad():
        got = model(tokens().to(backend.device)).cpu()
    torch.testing.assert_close(got, reference, rtol=TOLERANCE, atol=TOLERANCE)
    report["forward_max_diff"] = (got - reference).abs().max().item()
    report["load_seconds"] = result.seconds

    sw.save(model, f"{out}/full")
    if rank == 0:
        saved = st.load_file(f"{out}/full/model.safetensors")
        assert saved.keys() == canonical.keys()
        for name, t in canonical.items():
            assert torch.equal(saved[name].view(torch.uint8), t.view(torch.uint8)), name
    sw.save(model, f"{out}/dcp", distributed=True)
    back = fresh()
    sw.load(back, f"{out}/dcp", plan=tiny_plan(), mesh=backend.mesh(**load_at))
    check_shards(back)
    with torch.no_grad():
        torch.testing.assert_close(back(tokens().to(backend.device)).cpu(), reference,
                                   rtol=TOLERANCE, atol=TOLERANCE)
    return report


def test_load_forward_save_and_dcp_reshard_on_every_gpu(tmp_path):
    import safetensors.torch as st

    from harness import run_ranks
    from models import make_model

    world = _world()
    (tmp_path / "ckpt").mkdir()
    st.save_file({k: v.contiguous() for k, v in make_model().state_dict().items()},
                 tmp_path / "ckpt" / "model.safetensors")
    reports = run_ranks(_ranks, world, str(tmp_path / "ckpt"), str(tmp_path), timeout=600)
    save_at, load_at = _layouts(world)
    worst = max(r["forward_max_diff"] for r in reports)
    _say(f"world {world} ({torch.cuda.get_device_name(0)}): load at {save_at}: shards byte-exact, "
         f"bytes_read = regions; forward max |diff| vs CPU {worst:.2e}")
    _say("gather save: byte-exact")
    _say(f"DCP save at {save_at} + load at {load_at}: byte-exact, forward matches")
