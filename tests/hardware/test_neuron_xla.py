"""The neuron_xla suite (``tox -e neuron_xla``) for Trainium/Inferentia with the torch_xla-based
torch-neuronx (Trn1/Inf2, Neuron SDK 2.31 or earlier): tests/hardware/xla_multiprocess.py under
torchrun, one process per NeuronCore (``SHARDWISE_NEURON_NPROC``, default 2: a trn1.2xlarge has
2). Not yet run on Neuron hardware; the CPU suite runs the same script against a fake Neuron
stack (tests/dist/test_neuron_fake_ranks.py).

neuronx-cc compiles every new graph on first use (minutes for the first step; the cache under
/var/tmp/neuron-compile-cache makes reruns fast), hence the long timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _why_not() -> str | None:
    from shardwise.backends import neuron
    from shardwise.errors import BackendUnavailableError

    try:
        neuron.import_torch_neuronx_xla()
    except BackendUnavailableError as e:
        return str(e)
    if neuron.neuron_core_count() == 0:
        return f"no NeuronCore: the Neuron driver lists none under {neuron.NEURON_SYSFS}"
    return None


pytestmark = [pytest.mark.neuron]


def test_multiprocess_on_neuroncores(tmp_path):
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    nproc = os.environ.get("SHARDWISE_NEURON_NPROC", "2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc,
           str(here / "xla_multiprocess.py"), "--backend", "neuron_xla", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("shardwise ")]
    assert lines[0].startswith(f"shardwise neuron_xla: world {nproc},"), lines
    assert lines.count("shardwise ALL OK") == 1, lines
