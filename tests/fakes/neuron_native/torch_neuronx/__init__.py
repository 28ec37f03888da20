"""A fake TorchNeuron (torch-neuronx 2.13, the native backend; its package metadata beside it)
for the CPU suite. Importing it does what importing the real one does for shardwise: PrivateUse1
is named ``"neuron"`` (``torch.device("neuron")``, ``torch.neuron``) and ``init_process_group(
backend="neuron")`` works. No torch_xla anywhere.

The device is ``fakes.device``'s host-memory device (the built library named by
``SHARDWISE_FAKE_DEVICE_LIB``) and the ``neuron`` group is ``fakes.device.groups.DeviceGroup``:
it takes neuron tensors only, as NCCL takes CUDA tensors only. Whether the real group also takes
CPU tensors is not documented; the fake is the strict one, so code that passes here passes there.
NeuronCores are said by the fake sysfs tree (``shardwise.backends.neuron.NEURON_SYSFS``).
"""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[3])  # tests/: the fakes package
if _TESTS not in sys.path:
    sys.path.append(_TESTS)

from fakes import device as _device  # noqa: E402
from fakes.device import groups as _groups  # noqa: E402

FAKE = True
NATIVE = True

_device.use_privateuse1("neuron")
_groups.register_device_group("neuron", "neuron")
