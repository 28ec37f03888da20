"""A guard's error raised alike on every rank of a real torchrun reaches the user once (issue #32).

The script loads a two-layer model at degree 3, which its 16-wide layers do not divide: every
rank raises the same ``ShardingError`` before any collective. Issue #44: so do a missing
folder, a plan key with a typo, and a save refused by rank 0 for all (the folder exists).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

SCRIPT = """
import sys
import torch
from torch import nn
import shardwise as sw

backend = sw.init_backend("gloo")
with sw.empty_model():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
how = sys.argv[2]
if how in ("missing", "typo", "exists"):
    tp1 = backend.mesh(dp_replicate=3, tp=1)
if how == "missing":
    sw.load(model, sys.argv[1] + "/nothing", plan={"0": "colwise"}, mesh=tp1)
if how == "typo":
    sw.load(model, sys.argv[1], plan={"0": "colwise", "2.weigth": "rowwise"}, mesh=tp1)
if how == "exists":
    sw.load(model, sys.argv[1], plan={"0": "colwise"}, mesh=tp1)
    sw.save(model, sys.argv[1])
if how == "mesh":
    backend.mesh(tp=2)
# a rank-dependent plan when asked: the ranks then raise different messages
up = "0" if how == "same" or backend.rank == 0 else "2"
sw.load(model, sys.argv[1], plan={up: "colwise"}, mesh=backend.mesh(tp=backend.world_size))
"""


def _torchrun(tmp_path, how: str) -> subprocess.CompletedProcess:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    if not os.path.exists(torchrun):
        pytest.fail("torchrun is not installed next to this Python")
    layers = {"0.weight": torch.ones(16, 8), "0.bias": torch.ones(16),
              "2.weight": torch.ones(8, 16), "2.bias": torch.ones(8)}
    save_file(layers, str(tmp_path / "model.safetensors"))
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run([torchrun, "--standalone", "--nproc-per-node", "3", str(script),
                           str(tmp_path), how], capture_output=True, text=True, timeout=180, env=env)


def test_an_error_every_rank_raises_is_reported_once(tmp_path):
    proc = _torchrun(tmp_path, "same")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    printed = [line for line in out.splitlines() if line.startswith("ShardingError: plan key '0'")]
    assert len(printed) == 1, out                  # once on the ranks' stderr, by rank 0
    assert "Degrees that pass every check of this plan: 1, 2, 4, 8, 16" in printed[0], out
    assert "from a check all 3 ranks run alike" in out, out
    assert 'job.py, line 24: sw.load(model, sys.argv[1], plan={up: "colwise"}' in out, out  # the user's call
    assert out.count("Traceback (most recent call last)") == 1, out  # torchrun's own, no rank's
    assert "choose a degree that divides" not in out, out  # no cause contradicting the list
    # torchrun's summary: rank 0 first, with the error; the others point at it
    root = out.split("Root Cause (first observed failure):")[1]
    assert "rank      : 0 " in root and "exitcode  : 1 " in root and "ShardingError" in root, out
    assert out.count("the same ShardingError as rank 0 (reported there)") <= 2, out


def test_ranks_whose_errors_differ_each_report_their_own(tmp_path):
    proc = _torchrun(tmp_path, "differ")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert out.count("ShardingError: plan key '0'") >= 1, out
    # a rank whose message differs from rank 0's is never silenced
    assert "[rank1]: ShardingError: plan key '2'" in out or "[rank2]: ShardingError: plan key '2'" in out, out


@pytest.mark.parametrize("how, said", [
    ("missing", "CheckpointError: "),
    ("typo", "PlanError: plan key '2.weigth' matches nothing in Sequential; did you mean '2.weight'?"),
    ("exists", "CheckpointError: "),
    ("mesh", "MeshError: mesh tp=2 has 2 devices but the world size is 3"),
])
def test_paths_plans_and_refused_saves_are_reported_once(tmp_path, how, said):
    proc = _torchrun(tmp_path, how)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    printed = [line for line in out.splitlines() if line.startswith(said)]
    assert len(printed) == 1, out
    assert {"missing": "nothing", "typo": "tp=1 too", "exists": "already", "mesh": "multiply"}[how] \
        in printed[0], out
    assert "reported once, by rank 0" in out and "job.py, line" in out, out
    assert out.count("Traceback (most recent call last)") == 1, out  # torchrun's own, no rank's
