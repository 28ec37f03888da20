"""The neuron_xla backend (the torch_xla-based torch-neuronx) on spawned CPU ranks, against a fake
torch_neuronx 2.9 and a fake torch_xla (tests/fakes) that behave as the real ones do where
shardwise touches them: the XLA device is a real XLA-type device (host memory, so a CPU tensor
sent where an XLA tensor belongs is caught), the "xla" group refuses or ignores CPU tensors and
refuses a finite wait, and rank and world come from the (fake) PJRT runtime, which the fake
torch_neuronx tells the job's layout on import, as the Neuron plugin learns it.

This runs the multi-process xla path that torch-neuronx uses (init through xla://, the gloo
side group, GroupMesh, local shards with collectives in the forward, gather save and DCP
coordinated over the side group) on real ranks. It cannot show that Neuron hardware behaves
like the fake: docs/backends.md says what has run where.
"""

import os
import sys
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import shardwise as sw
from fakes import NEURON_XLA, XLA
from fakes import device as fake_device
from harness import run_ranks
from models import TinyTransformer, make_model, tiny_plan, tokens
from shardwise.core.spec import split
from shardwise.holding import Holding
from shardwise.parallel import get_shard_state


@pytest.fixture(scope="module")
def lib():
    return fake_device.require()


def _neuron_host(sysfs: str, lib: str) -> None:
    """Make this rank a (fake) Neuron host: package folders first, two NeuronCores in sysfs."""
    from shardwise.backends import neuron

    sys.path[:0] = [NEURON_XLA, XLA]
    os.environ["PJRT_DEVICE"] = "NEURON"
    os.environ[fake_device.LIB_ENV] = lib
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


def _init_and_place(sysfs: str, ckpt: str, lib: str):
    _neuron_host(sysfs, lib)
    import torch_xla

    backend = sw.init_backend("auto")
    assert backend.name == "neuron_xla" and backend.holding is Holding.LOCAL and torch_xla.FAKE
    calls = torch_xla.device_calls
    device = backend.device
    assert torch_xla.device_calls == calls + 1 and device.type == "xla"  # from torch_xla.device()
    assert (backend.world_size, backend.rank) == (1, 0)
    assert backend.coordination_group is not None  # the gloo side group for DCP
    model = _fresh()
    result = sw.load(model, ckpt, plan=tiny_plan(), mesh=backend.mesh(tp=1))
    canonical = _canonical()
    for name, t in model.state_dict().items():
        assert t.device == device, name
        assert torch.equal(t.cpu(), canonical[name]), name
    assert result.tensors == len(canonical)
    return type(get_shard_state(model).mesh).__name__


def _two_ranks(sysfs: str, ckpt: str, out: str, lib: str):
    _neuron_host(sysfs, lib)
    backend = sw.init_backend("auto")
    assert backend.name == "neuron_xla" and backend.world_size == 2
    import torch_xla.runtime as xr

    assert (xr.world_size(), xr.global_ordinal()) == (2, backend.rank)  # the runtime's view, not RANK's
    reference = make_model()(tokens()).detach()
    canonical = _canonical()
    results = {}
    for axes in ({"tp": 2}, {"dp_shard": 2, "tp": 1}, {"dp_replicate": 2, "tp": 1}):
        mesh = backend.mesh(**axes)
        model = _fresh()
        sw.load(model, ckpt, plan=tiny_plan(), mesh=mesh)
        state = get_shard_state(model)
        degree, rank = state.degree, state.tp_rank
        for name, spec in state.specs.items():
            want = canonical[name] if spec.replicated else split(canonical[name], spec, degree, rank)
            got = model.state_dict()[name]
            assert got.device.type == "xla" and torch.equal(got.cpu(), want), name
        with torch.no_grad():
            out_tp = model(tokens().to(backend.device)).cpu()
        torch.testing.assert_close(out_tp, reference, rtol=1e-5, atol=1e-5)
        results[tuple(axes)] = (degree, rank)
    # gather save and DCP from the degree-2 model, coordinated as on real hardware
    model = _fresh()
    sw.load(model, ckpt, plan=tiny_plan(), mesh=backend.mesh(tp=2))
    sw.save(model, f"{out}/full")
    sw.save(model, f"{out}/dcp", distributed=True)
    back = _fresh()
    sw.load(back, f"{out}/dcp", plan=tiny_plan(), mesh=backend.mesh(tp=2))
    for name, t in back.state_dict().items():
        assert torch.equal(t.cpu(), model.state_dict()[name].cpu()), name
    return results


def test_init_detects_the_fake_neuroncore_and_places_shards_on_its_device(tmp_path, lib):
    ckpt = tmp_path / "model.safetensors"
    st.save_file(_canonical(), ckpt)
    sysfs = _write_sysfs(tmp_path)
    assert run_ranks(_init_and_place, 1, sysfs, str(ckpt), lib) == ["GroupMesh"]


@pytest.mark.slow
def test_two_ranks_load_forward_replicas_save_and_dcp(tmp_path, lib):
    ckpt = tmp_path / "model.safetensors"
    canonical = _canonical()
    st.save_file(canonical, ckpt)
    sysfs = _write_sysfs(tmp_path)
    results = run_ranks(_two_ranks, 2, sysfs, str(ckpt), str(tmp_path), lib, timeout=180)
    assert results == [
        {("tp",): (2, 0), ("dp_shard", "tp"): (1, 0), ("dp_replicate", "tp"): (1, 0)},
        {("tp",): (2, 1), ("dp_shard", "tp"): (1, 0), ("dp_replicate", "tp"): (1, 0)},
    ]
    saved = st.load_file(tmp_path / "full" / "model.safetensors")
    assert saved.keys() == canonical.keys()
    for name, t in canonical.items():
        assert torch.equal(saved[name].view(torch.uint8), t.view(torch.uint8)), name


def _torchrun_script(tmp_path: Path, lib: str, *, neuron_host: bool) -> tuple[int, list[str], str]:
    """tests/hardware/xla_multiprocess.py under torchrun (2 processes) on the fakes: on a fake
    Neuron host (the runtime sees the job), or on fake PJRT CPU (each process a world of one)."""
    import subprocess

    from fakes import NEURON_SITE
    from shardwise.testing import free_port

    tests = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("FAKE_PJRT_")}
    src = str(tests.parent / "src")
    paths = [NEURON_SITE, NEURON_XLA, XLA] if neuron_host else [XLA]
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([*paths, src, env.get("PYTHONPATH", "")]))
    env[fake_device.LIB_ENV] = lib
    if neuron_host:
        env.update(PJRT_DEVICE="NEURON", FAKE_NEURON_SYSFS=_write_sysfs(tmp_path))
    else:
        env["PJRT_DEVICE"] = "CPU"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(tests / "hardware" / "xla_multiprocess.py"),
           "--backend", "neuron_xla" if neuron_host else "xla", "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("shardwise ")]
    return proc.returncode, lines, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.slow
def test_hardware_script_runs_under_torchrun_on_the_fake(tmp_path, lib):
    """The script Trainium runs, end to end under torchrun (2 ranks), so that the first run on
    hardware does not find a bug in the script itself."""
    code, lines, log = _torchrun_script(tmp_path, lib, neuron_host=True)
    assert code == 0, log
    assert lines[0] == "shardwise neuron_xla: world 2, device xla:0"
    assert lines[-1] == "shardwise ALL OK" and len(lines) == 6, lines


@pytest.mark.slow
def test_hardware_script_fails_where_each_process_is_a_world_of_one(tmp_path, lib):
    """On PJRT CPU under torchrun every process is rank 0 of a world of one: the script must
    fail, not print ALL OK once per process (issue 22: a false pass)."""
    code, lines, log = _torchrun_script(tmp_path, lib, neuron_host=False)
    assert code != 0, log
    assert "shardwise ALL OK" not in lines, lines
    assert "shardwise FAIL: world" in log and "WORLD_SIZE=2" in log and "runtime counts 1" in log, log
