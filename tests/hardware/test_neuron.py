"""The neuron suite (``tox -e neuron``) for Trainium with TorchNeuron (torch-neuronx 2.13/2.14,
native): ``shardwise validate --backend neuron`` under torchrun, one process per NeuronCore
(``SHARDWISE_NEURON_NPROC``, default 2), the JSON report written next to the test's output.
Not yet run on Neuron hardware; the CPU suite runs the same suite against a fake TorchNeuron
(tests/dist/test_neuron_native_fake.py). The torch_xla-based torch-neuronx is test_neuron_xla.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _why_not() -> str | None:
    from shardwise.backends import neuron

    version = neuron.torch_neuronx_version()
    if version is None or not neuron.is_native(version):
        return (f"TorchNeuron (torch-neuronx 2.13 or later) is not installed "
                f"(found: {'.'.join(map(str, version)) if version else 'none'}); {neuron.NEURON_HINT}")
    if neuron.neuron_core_count() == 0:
        return f"no NeuronCore: the Neuron driver lists none under {neuron.NEURON_SYSFS}"
    return None


pytestmark = [pytest.mark.neuron]


def test_validate_on_neuroncores(tmp_path):
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    nproc = os.environ.get("SHARDWISE_NEURON_NPROC", "2")
    report = tmp_path / f"neuron-{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc, "-m",
           "shardwise.validate", "--backend", "neuron", "--json", str(report),
           "--workdir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    run = json.loads(report.read_text())
    assert run["backend"] == "neuron" and run["world_size"] == int(nproc) and run["complete"]
