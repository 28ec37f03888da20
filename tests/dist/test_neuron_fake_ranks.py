"""The neuron backend on spawned CPU ranks, against a fake torch_neuronx and a fake torch_xla
whose "xla" device is the CPU and whose "xla" process group is gloo (tests/fakes/neuron).

This runs the multi-process xla path that torch-neuronx uses (init through xla://, the gloo
side group, GroupMesh, local shards with collectives in the forward, gather save and DCP
coordinated over the side group) on real ranks. It cannot show that Neuron hardware behaves
like the fake: docs/backends.md says what has run where.
"""

import sys
from pathlib import Path

import safetensors.torch as st
import torch

import shardwise as sw
from fakes import NEURON
from harness import run_ranks
from models import TinyTransformer, make_model, tiny_plan, tokens
from shardwise.core.spec import split


def _neuron_host(sysfs: str) -> None:
    """Make this rank a (fake) Neuron host: package folders first, two NeuronCores in sysfs."""
    import os

    from shardwise.backends import neuron

    sys.path.insert(0, NEURON)
    os.environ["PJRT_DEVICE"] = "NEURON"
    neuron.NEURON_SYSFS = Path(sysfs)


def _write_sysfs(root: Path) -> str:
    device = root / "neuron_device" / "neuron0"
    device.mkdir(parents=True)
    (device / "core_count").write_text("2\n")
    return str(root / "neuron_device")


def _canonical() -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in make_model().state_dict().items()}


def _fresh() -> TinyTransformer:
    with torch.device("meta"):
        return TinyTransformer()


def _init_and_place(sysfs: str, ckpt: str):
    _neuron_host(sysfs)
    import torch_xla

    backend = sw.init_backend("auto")
    assert backend.name == "neuron" and backend.holding == "local" and torch_xla.FAKE
    calls = torch_xla.device_calls
    device = backend.device
    assert torch_xla.device_calls == calls + 1  # the device comes from torch_xla.device()
    assert (backend.world_size, backend.rank) == (1, 0)
    assert backend.coordination_group is not None  # the gloo side group for DCP
    model = _fresh()
    result = sw.load(model, ckpt, plan=tiny_plan(), mesh=backend.mesh(tp=1))
    canonical = _canonical()
    for name, t in model.state_dict().items():
        assert t.device == device, name
        assert torch.equal(t, canonical[name]), name
    assert result.tensors == len(canonical)
    return type(sw.get_shard_state(model).mesh).__name__


def _two_ranks(sysfs: str, ckpt: str, out: str):
    _neuron_host(sysfs)
    backend = sw.init_backend("auto")
    assert backend.name == "neuron" and backend.world_size == 2
    reference = make_model()(tokens()).detach()
    canonical = _canonical()
    results = {}
    for axes in ({"tp": 2}, {"dp_shard": 2, "tp": 1}):
        mesh = backend.mesh(**axes)
        model = _fresh()
        sw.load(model, ckpt, plan=tiny_plan(), mesh=mesh)
        state = sw.get_shard_state(model)
        degree, rank = state.degree, state.tp_rank
        for name, spec in state.specs.items():
            want = canonical[name] if spec.replicated else split(canonical[name], spec, degree, rank)
            assert torch.equal(model.state_dict()[name], want), name
        with torch.no_grad():
            out_tp = model(tokens())
        torch.testing.assert_close(out_tp, reference, rtol=1e-5, atol=1e-5)
        results[len(axes)] = (degree, rank)
    # gather save and DCP from the degree-2 model, coordinated as on real hardware
    model = _fresh()
    sw.load(model, ckpt, plan=tiny_plan(), mesh=backend.mesh(tp=2))
    sw.save(model, f"{out}/full")
    sw.save(model, f"{out}/dcp", distributed=True)
    back = _fresh()
    sw.load(back, f"{out}/dcp", plan=tiny_plan(), mesh=backend.mesh(tp=2))
    for name, t in back.state_dict().items():
        assert torch.equal(t, model.state_dict()[name]), name
    return results


def test_init_detects_the_fake_neuroncore_and_places_shards_on_its_device(tmp_path):
    ckpt = tmp_path / "model.safetensors"
    st.save_file(_canonical(), ckpt)
    sysfs = _write_sysfs(tmp_path)
    assert run_ranks(_init_and_place, 1, sysfs, str(ckpt)) == ["GroupMesh"]


def test_two_ranks_load_forward_save_and_dcp(tmp_path):
    ckpt = tmp_path / "model.safetensors"
    canonical = _canonical()
    st.save_file(canonical, ckpt)
    sysfs = _write_sysfs(tmp_path)
    results = run_ranks(_two_ranks, 2, sysfs, str(ckpt), str(tmp_path))
    assert results == [{1: (2, 0), 2: (1, 0)}, {1: (2, 1), 2: (1, 0)}]
    saved = st.load_file(tmp_path / "full" / "model.safetensors")
    assert saved.keys() == canonical.keys()
    for name, t in canonical.items():
        assert torch.equal(saved[name].view(torch.uint8), t.view(torch.uint8)), name


def test_hardware_script_runs_under_torchrun_on_the_fake(tmp_path):
    """tests/hardware/xla_multiprocess.py, the script Trainium runs, end to end under torchrun
    (2 ranks), so that the first run on hardware does not find a bug in the script itself."""
    import os
    import subprocess

    from fakes import NEURON_SITE
    from shardwise.launch import free_port

    tests = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    src = str(tests.parent / "src")
    env.update(PJRT_DEVICE="NEURON", OMP_NUM_THREADS="1", FAKE_NEURON_SYSFS=_write_sysfs(tmp_path),
               PYTHONPATH=os.pathsep.join([NEURON_SITE, NEURON, src, env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(tests / "hardware" / "xla_multiprocess.py"),
           "--backend", "neuron", "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("shardwise ")]
    assert lines[0] == "shardwise neuron: world 2, device cpu"
    assert lines[-1] == "shardwise ALL OK" and len(lines) == 6, lines
