"""A fake torch_xla-based torch_neuronx (torch-neuronx 2.9, its package metadata beside it) for
the CPU suite: importable, and on import it tells the fake PJRT runtime (tests/fakes/xla) the
job's layout from the launcher's variables, as the real package's Neuron PJRT plugin learns it.

Whether a NeuronCore exists is said by a fake Neuron sysfs tree
(``shardwise.backends.neuron.NEURON_SYSFS``), as the Neuron driver says it on a real host.
"""

import os

FAKE = True
NATIVE = False

if "WORLD_SIZE" in os.environ:
    os.environ.setdefault("FAKE_PJRT_WORLD_SIZE", os.environ["WORLD_SIZE"])
    os.environ.setdefault("FAKE_PJRT_ORDINAL", os.environ.get("RANK", "0"))
    os.environ.setdefault("FAKE_PJRT_LOCAL_ORDINAL", os.environ.get("LOCAL_RANK", "0"))
