"""The multi-process xla / neuron_xla check, one process per device, launched by torchrun:

    PJRT_DEVICE=TPU torchrun --nproc-per-node 4 tests/hardware/xla_multiprocess.py --backend xla --out /tmp/sw
    torchrun --nproc-per-node 2 tests/hardware/xla_multiprocess.py --backend neuron_xla --out /tmp/sw

(tests/hardware/test_xla.py and test_neuron_xla.py run it so when the hardware is there.) First
the world: the backend's world size must equal the launcher's WORLD_SIZE and the PJRT runtime's
own count (``xr.world_size()``), or the script fails before any check, so that processes that
each see a world of one (torch_xla on PJRT CPU) can never print ``ALL OK``. Then every
rank: streaming load at degree = world size (and at dp_shard=2 x tp=world/2 when the world
is even), each local shard byte-equal to its slice of the canonical tensor, the
forward against the one-process CPU forward, a gather save whose tensors are byte-equal to
the canonical ones, and a DCP save loaded back at another layout. Rank 0 prints one line per
check and ``ALL OK``; any failure exits non-zero with the rank's traceback.

On the CPU, several PJRT processes each see a world of one, so this cannot run there (it fails
at the world check); the CPU suite runs it under torchrun against a fake Neuron stack
(tests/dist/test_neuron_fake_ranks.py), and against fake PJRT CPU to see that it fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from shardwise.parallel import get_shard_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: models

import safetensors.torch as st  # noqa: E402
import torch  # noqa: E402

import shardwise as sw  # noqa: E402
from models import TinyTransformer, make_model, tiny_plan, tokens  # noqa: E402
from shardwise.core.spec import split  # noqa: E402

# fp32 on accelerators: TPU matmuls run at full precision only when asked (below), neuronx-cc
# casts fp32 matmuls to bf16 unless --auto-cast=none; what remains is summation order.
TOLERANCE = {"xla": 2e-3, "neuron_xla": 2e-3}


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"shardwise {text}", flush=True)


def _fresh() -> TinyTransformer:
    with torch.device("meta"):
        return TinyTransformer()


def _check_shards(model, canonical) -> None:
    state = get_shard_state(model)
    for name, spec in state.specs.items():
        want = (canonical[name] if spec.replicated
                else split(canonical[name], spec, state.degree, state.tp_rank))
        got = model.state_dict()[name].cpu()
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), name


def _check_world(backend) -> None:
    """The backend's world is the launcher's and the runtime's: else each process may be a world
    of its own, every one rank 0, and every one would print ALL OK."""
    import torch_xla.runtime as xr

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    runtime = int(xr.world_size())
    if not backend.world_size == launched == runtime:
        raise SystemExit(f"shardwise FAIL: world: backend {backend.name!r} has a world of "
                         f"{backend.world_size}, the launcher started WORLD_SIZE={launched}, the PJRT "
                         f"runtime counts {runtime}: these processes do not form one job (torch_xla "
                         "on PJRT CPU has no multi-process collectives)")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("xla", "neuron_xla"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.backend == "neuron_xla":
        os.environ.setdefault("NEURON_CC_FLAGS", "--auto-cast=none")
    backend = sw.init_backend(args.backend)
    _check_world(backend)
    if args.backend == "xla":
        try:
            import torch_xla.backends

            torch_xla.backends.set_mat_mul_precision("highest")
        except (ImportError, AttributeError):  # an older torch_xla: default precision
            pass
    rank, world, device = backend.rank, backend.world_size, backend.device
    out = Path(args.out)
    _say(rank, f"{args.backend}: world {world}, device {device}")
    canonical = {k: v.contiguous() for k, v in make_model().state_dict().items()}
    if rank == 0:
        (out / "ckpt").mkdir(parents=True, exist_ok=True)
        st.save_file(canonical, out / "ckpt" / "model.safetensors")
    backend.barrier()
    reference = make_model()(tokens()).detach()
    layouts = [{"tp": world}]
    if world % 2 == 0:
        layouts.append({"dp_shard": 2, "tp": world // 2})
    models = []
    for axes in layouts:
        model = _fresh()
        sw.load(model, out / "ckpt", plan=tiny_plan(), mesh=backend.mesh(**axes))
        _check_shards(model, canonical)
        with torch.no_grad():
            got = model(tokens().to(device)).cpu()
        tol = TOLERANCE[args.backend]
        torch.testing.assert_close(got, reference, rtol=tol, atol=tol)
        diff = (got - reference).abs().max().item()
        _say(rank, f"load + forward at {axes}: shards byte-exact, max |diff| vs CPU {diff:.2e}: OK")
        models.append(model)
    sw.save(models[0], out / "full", overwrite=True)
    if rank == 0:
        saved = st.load_file(out / "full" / "model.safetensors")
        assert saved.keys() == canonical.keys()
        for name, t in canonical.items():
            assert torch.equal(saved[name].view(torch.uint8), t.view(torch.uint8)), name
    backend.barrier()
    _say(rank, "gather save: byte-exact: OK")
    sw.save(models[0], out / "dcp", distributed=True, overwrite=True)
    back = _fresh()
    sw.load(back, out / "dcp", plan=tiny_plan(), mesh=backend.mesh(**layouts[-1]))
    _check_shards(back, canonical)
    _say(rank, f"DCP save at {layouts[0]} + load at {layouts[-1]}: byte-exact: OK")
    _say(rank, "ALL OK")
    sw.shutdown_backend()
    return 0


if __name__ == "__main__":
    sys.exit(main())
