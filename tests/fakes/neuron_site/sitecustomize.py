"""Points shardwise's neuron backend at the fake Neuron sysfs tree named by FAKE_NEURON_SYSFS,
for a script that a test launches (torchrun) and that cannot be handed the path itself."""

import os

if os.environ.get("FAKE_NEURON_SYSFS"):
    from pathlib import Path

    from shardwise.backends import neuron

    neuron.NEURON_SYSFS = Path(os.environ["FAKE_NEURON_SYSFS"])
