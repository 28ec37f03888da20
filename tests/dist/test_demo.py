"""``shardwise demo`` runs end to end: it streams on spawned gloo ranks and prints its table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.slow
def test_demo_tiny_tp2_keeps_its_checkpoint(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    keep = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "shardwise", "demo", "--tp", "2", "--size", "tiny", "--keep", str(keep)],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "bytes read" in out and "peak RSS" in out and "seconds" in out
    rows = re.findall(r"^\s+([01])\s+([\d.,]+) MB\s+[\d.,]+ MB\s+[\d.]+\s+([\d.,]+) MB", out, re.M)
    assert [r[0] for r in rows] == ["0", "1"], out
    for _, streamed, whole in rows:  # each rank read about half of what load_file reads
        assert float(streamed.replace(",", "")) < 0.6 * float(whole.replace(",", ""))
    assert re.search(r"forward check against one process: max \|diff\| = \S+ \(tolerance [^)]+\): OK", out)
    files = sorted(p.name for p in keep.iterdir())
    assert "model.safetensors.index.json" in files
    assert sum(name.endswith(".safetensors") for name in files) >= 3
    # the gather save, the distributed save and the reshard, each with its figures
    assert re.search(r"^\s*rank\s+peak RSS\s+seconds\s+peak RSS\s+seconds\s+bytes read", out, re.M), out
    assert "Same tensors as the model: OK" in out
    assert re.search(r"reshard: the tp=2 distributed checkpoint loaded at tp=1 .*: OK", out), out
    assert "peak RSS: the most RAM each rank's process held during the step" in out
    saved = keep.with_name("ckpt-saved")
    assert (saved / "full" / "model.safetensors").is_file() and any((saved / "dcp").glob("*.distcp"))
