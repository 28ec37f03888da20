"""Fake hardware packages for the default (CPU) suite: put the folders first on ``sys.path``.

Each fails where the hardware (or the real package) fails; see each one's docstring for what it
accepts and refuses:

- ``XLA``: a fake ``torch_xla`` (2.9 on PJRT CPU unless the fake runtime is told the job's
  layout): an XLA-type host-memory device, the ``xla`` group as torch_xla's behaves, the xla://
  rendezvous from the runtime's ordinal and world.
- ``NEURON_XLA``: the torch_xla-based ``torch_neuronx`` (2.9; with ``XLA``).
- ``NEURON_NATIVE``: TorchNeuron (2.13): the ``neuron`` device and its device-only group.
- ``NEURON_PLACEHOLDER``: a ``torch_neuronx`` that raises on import, like the placeholder package
  of that name on PyPI.
- ``NEURON_SITE``: a sitecustomize pointing shardwise at the fake sysfs tree in
  ``FAKE_NEURON_SYSFS`` (for scripts that torchrun starts).
- ``fakes.device``: the host-memory device (a C++ extension, built once) and the groups.

The device-backed fakes need ``SHARDWISE_FAKE_DEVICE_LIB`` (``fakes.device.build()``) in the
process that imports them.
"""

from pathlib import Path

_HERE = Path(__file__).parent
XLA = str(_HERE / "xla")
NEURON_XLA = str(_HERE / "neuron_xla")
NEURON_NATIVE = str(_HERE / "neuron_native")
NEURON_PLACEHOLDER = str(_HERE / "neuron_placeholder")
NEURON_SITE = str(_HERE / "neuron_site")               # sitecustomize: FAKE_NEURON_SYSFS
