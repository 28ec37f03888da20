"""The xla suite (``tox -e xla``): torch_xla on PJRT; CPU devices here, TPU on a TPU host.

Each case runs in a fresh interpreter: SPMD is process-global (``xr.use_spmd()``) and PJRT
reads ``CPU_NUM_DEVICES`` once, so the one-device cases and the SPMD cases cannot share a
process. XLA's fp32 matmuls are not bit-exact against the CPU's (tolerance below); tensors
that are only moved or cast are compared byte for byte.

- one device, ``init_backend("xla")``: two such processes at once on the CPU (a world of one
  must not take torch_xla's fixed rendezvous port), load, forward against CPU, a bf16 load, gather
  save, DCP round trip;
- SPMD, ``init_backend("xla_spmd")`` over every device (4 CPU devices here): degree-4 load
  and forward against CPU, a dp_shard x tp mesh, parallelize, gather save, a DCP save loaded
  back at another layout (and by a one-device process), the chunk checks; an AdamW state
  saved at tp=4 and loaded at dp_shard=2 x tp=2 (byte-exact, split like its parameters);
- ``shardwise validate --backend xla_spmd`` over 4 and 8 CPU devices (every chip on a TPU VM);
- several processes (TPU only): tests/hardware/xla_multiprocess.py under torchrun.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.xla,
    pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None,
                       reason="torch_xla is not installed (tox -e xla installs it)"),
]

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
DOCS = TESTS.parent / "docs"
TOLERANCE = 1e-4  # fp32 linear on XLA vs CPU: ~1e-6 relative, up to ~2e-4 absolute on randn data
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env(devices: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV and k != "CPU_NUM_DEVICES"}
    env.setdefault("PJRT_DEVICE", "CPU")
    if devices is not None and env["PJRT_DEVICE"] == "CPU":
        env["CPU_NUM_DEVICES"] = str(devices)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(TESTS), env.get("PYTHONPATH", "")])
    return env


def _start(case: str, tmp: Path, devices: int | None = None) -> subprocess.Popen:
    code = f"import test_xla; test_xla.{case}({str(tmp)!r})"
    return subprocess.Popen([sys.executable, "-c", code], env=_env(devices), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> None:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"case still running after {timeout:.0f} s:\n{_quiet(out)}")
    assert proc.returncode == 0, _quiet(out)


def _quiet(out: str) -> str:
    noise = ("WARNING: All log messages before absl", "GSPMD sharding propagation", "Shardy")
    return "\n".join(line for line in out.splitlines() if not any(n in line for n in noise))[-6000:]


def test_one_device(tmp_path):
    # On the CPU two at once: a world of one must not hold torch_xla's fixed rendezvous port.
    # A TPU's chips belong to one process at a time, so there it is one.
    at_once = 2 if _env(None)["PJRT_DEVICE"] == "CPU" else 1
    procs = [_start("case_one_device", tmp_path / f"p{i}") for i in range(at_once)]
    for proc in procs:
        _finish(proc)


def test_spmd(tmp_path):
    _finish(_start("case_spmd", tmp_path, devices=4))
    _finish(_start("case_load_spmd_dcp_on_one_device", tmp_path))


def test_spmd_optimizer_reshard(tmp_path):
    _finish(_start("case_spmd_optimizer", tmp_path, devices=4))


@pytest.mark.parametrize("devices", [4, 8])
def test_validate_spmd(tmp_path, devices):
    """``shardwise validate --backend xla_spmd`` over 4 and 8 PJRT CPU devices (on a TPU VM: over
    its chips, once): every scenario PASS or UNSUPPORTED with a reason. With
    ``SHARDWISE_VALIDATE_DOCS=1`` the JSON goes to docs/validate/xla_spmd-N.json (ci/validate-docs.sh)."""
    on_cpu = _env(None)["PJRT_DEVICE"] == "CPU"
    if not on_cpu and devices != 4:
        pytest.skip("on a TPU VM the suite runs once, over every chip")
    folder = DOCS / "validate" if os.environ.get("SHARDWISE_VALIDATE_DOCS") == "1" else tmp_path
    out = folder / f"xla_spmd-{devices}.json" if on_cpu else folder / "xla_spmd-tpu.json"
    cmd = [sys.executable, "-m", "shardwise.validate", "--backend", "xla_spmd", "--json", str(out)]
    proc = subprocess.run(cmd, env=_env(devices if on_cpu else None), capture_output=True, text=True,
                          timeout=1800)
    assert out.exists(), f"no report written:\n{_quiet(proc.stdout + proc.stderr)}"
    run = json.loads(out.read_text())
    problems = [f"{r['scenario']} @ {r['layout']}: {r['status']}: {r['reason']}" for r in run["results"]
                if r["status"] not in ("PASS", "UNSUPPORTED") or not (r["status"] == "PASS" or r["reason"])]
    assert not problems, "\n".join(problems)
    assert proc.returncode == 0 and run["ok"] and run["complete"], _quiet(proc.stdout + proc.stderr)
    assert (run["backend"], run["holding"], run["processes"]) == ("xla_spmd", "spmd", 1)
    assert run.get("only") is None  # the whole suite, not a partial run
    if on_cpu:
        assert run["world_size"] == devices
    assert sum(r["status"] == "PASS" for r in run["results"]) > len(run["layouts"]) * 5  # it ran


@pytest.mark.skipif(os.environ.get("PJRT_DEVICE", "CPU") != "TPU",
                    reason="several PJRT CPU processes each see a world of one, so multi-process "
                           "xla collectives run on TPU only (PJRT_DEVICE=TPU)")
def test_multiprocess_on_tpu(tmp_path):
    nproc = os.environ.get("SHARDWISE_XLA_NPROC", "4")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc,
           str(HERE / "xla_multiprocess.py"), "--backend", "xla", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=_env(None), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, _quiet(proc.stdout + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("shardwise ")]
    assert lines[0].startswith(f"shardwise xla: world {nproc},"), lines  # one job, not worlds of one
    assert lines.count("shardwise ALL OK") == 1, lines


# --- the cases: each runs alone in a fresh interpreter --------------------------------------

def _setup(tmp: str):
    """(canonical tensors, checkpoint folder, CPU reference output) in ``tmp``. Also asks for
    full-precision fp32 matmuls (a TPU's default multiplies in bf16; the CPU's already is)."""
    import safetensors.torch as st
    import torch_xla.backends
    import torch_xla.runtime as xr

    from models import make_model, tokens

    if xr.device_type() != "CPU":
        torch_xla.backends.set_mat_mul_precision("highest")
    Path(tmp).mkdir(parents=True, exist_ok=True)
    model = make_model()
    canonical = {k: v.contiguous() for k, v in model.state_dict().items()}
    (Path(tmp) / "ckpt").mkdir(exist_ok=True)
    st.save_file(canonical, Path(tmp) / "ckpt" / "model.safetensors")
    return canonical, str(Path(tmp) / "ckpt"), model(tokens()).detach()


def _fresh():
    import torch

    from models import TinyTransformer

    with torch.device("meta"):
        return TinyTransformer()


def _same_bytes(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _check_forward(model, device, reference) -> None:
    import torch

    from models import tokens

    with torch.no_grad():
        got = model(tokens().to(device)).cpu()
    torch.testing.assert_close(got, reference, rtol=TOLERANCE, atol=TOLERANCE)


def _check_saved(folder: Path, canonical) -> None:
    import safetensors.torch as st

    saved = st.load_file(folder / "model.safetensors")
    assert saved.keys() == canonical.keys()
    for name, t in canonical.items():
        assert _same_bytes(saved[name], t), name


def case_one_device(tmp: str) -> None:
    import torch

    import shardwise as sw
    from models import make_model, tiny_plan

    canonical, ckpt, reference = _setup(tmp)
    backend = sw.init_backend("xla")
    assert (backend.name, backend.world_size, str(backend.holding)) == ("xla", 1, "local")
    assert backend.device.type == "xla" and backend.coordination_group is not None
    mesh = backend.mesh(tp=1)
    assert type(mesh).__name__ == "GroupMesh"
    # collectives on device tensors over the xla group; objects over the gloo side group
    t = torch.arange(3.0, device=backend.device)
    assert torch.equal(backend.all_reduce(t.clone()).cpu(), t.cpu())
    assert [g.cpu().tolist() for g in backend.gather(t)] == [[0.0, 1.0, 2.0]]  # an all-gather
    backend.barrier()
    import torch.distributed as dist

    got = [None]
    dist.all_gather_object(got, {"rank": backend.rank}, group=backend.coordination_group)
    assert got == [{"rank": 0}]

    model = _fresh()
    result = sw.load(model, ckpt, plan=tiny_plan(), mesh=mesh)
    assert result.tensors == len(canonical)
    for name, t in model.state_dict().items():
        assert t.device.type == "xla", name
        assert _same_bytes(t.cpu(), canonical[name]), name  # moved to the device: byte-exact
    _check_forward(model, backend.device, reference)

    half = _fresh()
    sw.load(half, ckpt, plan=tiny_plan(), mesh=mesh, dtype=torch.bfloat16)
    for name, t in half.state_dict().items():
        assert _same_bytes(t.cpu(), canonical[name].to(torch.bfloat16)), name

    moved = make_model()
    sw.parallelize(moved, tiny_plan(), mesh)
    _check_forward(moved, backend.device, reference)

    sw.save(model, Path(tmp) / "full")
    _check_saved(Path(tmp) / "full", canonical)
    sw.save(model, Path(tmp) / "dcp", distributed=True)
    back = _fresh()
    sw.load(back, Path(tmp) / "dcp", plan=tiny_plan(), mesh=mesh)
    for name, t in back.state_dict().items():
        assert t.device.type == "xla" and _same_bytes(t.cpu(), canonical[name]), name
    sw.shutdown_backend()


def case_spmd(tmp: str) -> None:
    import torch
    import torch_xla
    import torch_xla.runtime as xr

    import shardwise as sw
    from models import make_model, tiny_plan
    from shardwise.core.spec import ShardSpec, shard_regions

    canonical, ckpt, reference = _setup(tmp)
    xr.use_spmd()
    with pytest.raises(sw.errors.BackendError, match="xla_spmd"):
        sw.init_backend("xla")  # SPMD is on: the one-process-per-device backend refuses
    backend = sw.init_backend("auto")
    assert (backend.name, str(backend.holding), backend.world_size) == ("xla_spmd", "spmd", 1)
    n = int(xr.global_runtime_device_count())
    assert n >= 2 and n % 2 == 0, f"the SPMD case needs an even number of devices, got {n}"

    spec_of = torch_xla._XLAC._get_xla_sharding_spec
    models = {}
    for axes in ({"tp": n}, {"dp_shard": 2, "tp": n // 2}):
        mesh = backend.mesh(**axes)
        model = _fresh()
        result = sw.load(model, ckpt, plan=tiny_plan(), mesh=mesh)
        assert result.tensors == len(canonical) and result.bytes_read == sum(
            t.numel() * t.element_size() for t in canonical.values())  # each chunk read once
        for name, t in model.state_dict().items():
            assert _same_bytes(t.cpu(), canonical[name]), name  # global tensors stay canonical
        tp = axes["tp"]
        assert spec_of(model.layers[0].attn.q.weight).startswith(f"{{devices=[{tp},1")   # colwise
        assert spec_of(model.layers[0].attn.o.weight).startswith(f"{{devices=[1,{tp}")   # rowwise
        assert spec_of(model.norm_out.weight) == "{replicated}"
        _check_forward(model, backend.device, reference)
        models[len(axes)] = model

    moved = make_model()
    sw.parallelize(moved, tiny_plan(), backend.mesh(tp=n))
    _check_forward(moved, backend.device, reference)

    sw.save(models[1], Path(tmp) / "full")
    _check_saved(Path(tmp) / "full", canonical)

    # DCP: each device's chunk is written once, at its canonical offsets
    sw.save(models[1], Path(tmp) / "spmd_dcp", distributed=True)
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(Path(tmp) / "spmd_dcp")).read_metadata().state_dict_metadata
    name = "single.0.proj_in.weight"
    chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md[name].chunks)
    shape = tuple(canonical[name].shape)
    assert chunks == [(r.offsets, r.sizes) for p in range(n)
                      for r in shard_regions(shape, ShardSpec(dim=0), n, p)]
    assert len(md["norm_out.weight"].chunks) == 1
    back = _fresh()
    sw.load(back, Path(tmp) / "spmd_dcp", plan=tiny_plan(), mesh=backend.mesh(dp_shard=2, tp=n // 2),
            dtype=torch.bfloat16)
    for name, t in back.state_dict().items():
        assert _same_bytes(t.cpu(), canonical[name].to(torch.bfloat16)), name

    # a chunk of the wrong dtype is refused before torch_xla sees it
    tp_mesh = backend.mesh(tp=n)
    bad = {p: torch.zeros(2, 3, dtype=torch.float64 if p == 1 else torch.float32) for p in range(n)}
    with pytest.raises(sw.errors.ShardingError, match="chunk 1"):
        tp_mesh.from_chunks(bad, (2 * n, 3), 0, torch.float32, name="w")
    sw.shutdown_backend()


def case_load_spmd_dcp_on_one_device(tmp: str) -> None:
    """The DCP checkpoint the SPMD case wrote loads in a one-process-per-device world."""
    import safetensors.torch as st

    import shardwise as sw
    from models import tiny_plan

    canonical = st.load_file(Path(tmp) / "ckpt" / "model.safetensors")
    backend = sw.init_backend("xla")
    model = _fresh()
    sw.load(model, Path(tmp) / "spmd_dcp", plan=tiny_plan(), mesh=backend.mesh(tp=1))
    for name, t in model.state_dict().items():
        assert _same_bytes(t.cpu(), canonical[name]), name
    sw.shutdown_backend()


def case_spmd_optimizer(tmp: str) -> None:
    """An AdamW state saved at tp=n loads at dp_shard=2 x tp=n/2: byte-exact, each state tensor
    split like its parameter, and the step on the devices equals the CPU's."""
    import torch
    import torch_xla
    import torch_xla.runtime as xr

    import shardwise as sw
    from models import make_model, tiny_plan, tokens

    _, ckpt, _ = _setup(tmp)
    backend = sw.init_backend("xla_spmd")
    n = int(xr.global_runtime_device_count())
    model = _fresh()
    sw.load(model, ckpt, plan=tiny_plan(), mesh=backend.mesh(tp=n))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(tokens().to(backend.device)).square().mean().backward()
    optimizer.step()
    torch_xla.sync()
    names = dict(model.named_parameters())
    saved = {(n_, k): v.cpu() for n_, p in names.items() for k, v in optimizer.state[p].items()}
    sw.save_optimizer(model, optimizer, Path(tmp) / "optim")
    # The one-process CPU run of the same step. After the XLA backward: autograd sizes its
    # device queues at its first backward, and one on the CPU first leaves no queue for XLA.
    reference = make_model()
    cpu_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    reference(tokens()).square().mean().backward()
    cpu_opt.step()

    resumed = _fresh()
    sw.load(resumed, ckpt, plan=tiny_plan(), mesh=backend.mesh(dp_shard=2, tp=n // 2))
    again = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    sw.load_optimizer(resumed, again, Path(tmp) / "optim")
    spec_of = torch_xla._XLAC._get_xla_sharding_spec
    want = dict(reference.named_parameters())
    for name, p in resumed.named_parameters():
        state = again.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, name
        assert float(state["step"]) == 1.0, name
        for key in ("exp_avg", "exp_avg_sq"):
            assert _same_bytes(state[key].cpu(), saved[(name, key)]), (name, key)
            assert spec_of(state[key]) == spec_of(p), (name, key)  # split like its parameter
            torch.testing.assert_close(state[key].cpu(), cpu_opt.state[want[name]][key],
                                       rtol=TOLERANCE, atol=TOLERANCE)
    sw.shutdown_backend()
