"""gloo on real spawned ranks: meshes and every collective against known values."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import shardwise as sw
from harness import RankFailure, run_ranks


def _collectives() -> dict:
    b = sw.init_backend("gloo")
    r, w = b.rank, b.world_size
    out = {"rank": r, "world": w, "local_rank": b.local_rank, "device": str(b.device)}
    out["sum"] = b.all_reduce(torch.tensor([r + 1.0, 2.0 * r])).tolist()
    out["max"] = b.all_reduce(torch.tensor([float(r)]), op="max").item()
    out["gathered_all"] = [t.tolist() for t in b.all_gather(torch.tensor([r, 10 * r]))]
    got = b.gather(torch.tensor([r * r]), dst=0)
    out["gathered_0"] = None if got is None else [t.item() for t in got]
    out["bcast"] = b.broadcast(torch.tensor([float(r)]) if r else torch.tensor([42.0]), src=0).item()
    b.barrier()
    mesh = b.mesh(tp=w)
    out["mesh"] = (mesh.mesh_dim_names, tuple(mesh.shape))
    if w == 4:
        m2 = b.mesh(dp_shard=2, tp=2)
        tp_group = m2["tp"].get_group()
        out["mesh2"] = (m2.mesh_dim_names, tuple(m2.shape), m2["tp"].get_local_rank(),
                        m2["dp_shard"].get_local_rank())
        # reduce within the tp axis only: ranks {0,1} and {2,3}
        out["tp_sum"] = b.all_reduce(torch.tensor([float(r)]), group=tp_group).item()
        out["tp_gather"] = [t.item() for t in b.all_gather(torch.tensor([r]), group=tp_group)]
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_collectives_and_meshes(world):
    results = run_ranks(_collectives, world)
    n = world
    for r, out in enumerate(results):
        assert (out["rank"], out["world"], out["local_rank"]) == (r, n, r)
        assert out["device"] == "cpu"
        assert out["sum"] == [n * (n + 1) / 2, 2.0 * n * (n - 1) / 2]
        assert out["max"] == n - 1
        assert out["gathered_all"] == [[i, 10 * i] for i in range(n)]
        assert out["gathered_0"] == ([i * i for i in range(n)] if r == 0 else None)
        assert out["bcast"] == 42.0
        assert out["mesh"] == (("tp",), (n,))
        if n == 4:
            names, shape, tp_rank, dp_rank = out["mesh2"]
            assert names == ("dp_shard", "tp") and shape == (2, 2)
            assert (dp_rank, tp_rank) == divmod(r, 2)
            pair = [2 * (r // 2), 2 * (r // 2) + 1]
            assert out["tp_sum"] == sum(pair)
            assert out["tp_gather"] == pair


def _bad_mesh():
    b = sw.init_backend("gloo")
    b.mesh(tp=3)


def test_mesh_error_names_product_and_world():
    with pytest.raises(RankFailure) as e:
        run_ranks(_bad_mesh, 2)
    assert "3 devices but the world size is 2" in str(e.value)


def _raises_on_rank_one():
    b = sw.init_backend("gloo")
    if b.rank == 1:
        raise KeyError("rank one is broken")
    b.barrier(timeout=30)


def test_harness_reports_a_failing_rank_with_its_traceback():
    with pytest.raises(RankFailure) as e:
        run_ranks(_raises_on_rank_one, 2, timeout=60)
    assert 1 in e.value.failures
    report = e.value.failures[1]
    assert "rank one is broken" in report and "_raises_on_rank_one" in report
    assert "Traceback" in report


def _hangs_on_rank_zero():
    b = sw.init_backend("gloo")
    if b.rank == 0:
        time.sleep(600)
    b.barrier(timeout=600)


def test_harness_kills_hung_ranks_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_ranks(_hangs_on_rank_zero, 2, timeout=8)
    assert time.monotonic() - start < 30
    assert set(e.value.failures) == {0, 1}
    assert "timed out" in str(e.value)


def _collective_timeout():
    b = sw.init_backend("gloo")
    if b.rank == 0:
        b.barrier(timeout=2)  # rank 1 never joins
    else:
        time.sleep(20)


def test_collective_timeout_raises_collective_error():
    with pytest.raises(RankFailure) as e:
        run_ranks(_collective_timeout, 2, timeout=60)
    assert "CollectiveError" in e.value.failures[0] and "barrier" in e.value.failures[0]


TORCHRUN_SCRIPT = """
import json, sys, torch, shardwise as sw
b = sw.init_backend("gloo")
t = b.all_reduce(torch.tensor([b.rank + 1.0]))
mesh = b.mesh(tp=b.world_size)
with open(f"{sys.argv[1]}/rank{b.rank}.json", "w") as f:
    json.dump({"rank": b.rank, "world": b.world_size, "local_rank": b.local_rank,
               "sum": t.item(), "mesh": list(mesh.shape)}, f)
sw.shutdown_backend()
"""


def test_real_torchrun_launch(tmp_path):
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    if not os.path.exists(torchrun):
        pytest.fail("torchrun is not installed next to this Python")
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(script),
                           str(tmp_path)],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:] + proc.stdout
    import json

    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(d["rank"], d["world"], d["local_rank"], d["sum"], d["mesh"]) for d in rows] == [
        (0, 2, 0, 3.0, [2]), (1, 2, 1, 3.0, [2])]
