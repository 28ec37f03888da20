"""AWS Trainium/Inferentia through torch-neuronx, which builds on torch_xla.

torch-neuronx's documented model (its training developer guide): each NeuronCore is an XLA
device (``torch_xla.device()``), one process per NeuronCore launched by ``torchrun``, joined
by ``init_process_group("xla")``; importing torch_neuronx registers the Neuron PJRT plugin
(``PJRT_DEVICE=NEURON``). So everything but detection and the messages is the xla backend:
local shards with forward hooks, a gloo side group for DCP, shard-on-host-then-move loads.

Detection never starts the Neuron runtime (that would claim the NeuronCores before torch_xla's
rendezvous hands each process its own): the NeuronCores are counted from the Neuron driver's
sysfs tree (``/sys/devices/virtual/neuron_device/neuron*/core_count``). torch_neuronx is
imported only inside functions.

This targets the torch_xla-based torch-neuronx. The native TorchNeuron stack of recent Neuron
releases (device ``neuron``, process group backend ``neuron``, DTensor support) is a
different backend and is not covered here.
"""

from __future__ import annotations

from pathlib import Path

from shardwise.backends.xla import XlaBackend
from shardwise.errors import BackendError, BackendUnavailableError

NEURON_HINT = ("install torch-neuronx from the AWS Neuron package repository "
               "(pip install 'shardwise[neuron]' --extra-index-url https://pip.repos.neuron.amazonaws.com); "
               "the package of that name on PyPI is a placeholder")
# Where the Neuron driver lists its devices; a module attribute so that tests can point it
# at a fake tree.
NEURON_SYSFS = Path("/sys/devices/virtual/neuron_device")


def import_torch_neuronx():
    try:
        import torch_neuronx
    except Exception as e:  # the PyPI placeholder raises a non-ImportError on import
        raise BackendUnavailableError(
            f"backend 'neuron' needs torch_neuronx, which is not importable ({e}); {NEURON_HINT}"
        ) from e
    return torch_neuronx


def neuron_core_count() -> int:
    """NeuronCores the Neuron driver shows on this host (0 when it shows none). Reads sysfs
    only: it neither imports torch_neuronx nor starts the Neuron runtime.

    >>> neuron_core_count()   # on a trn1.2xlarge  # doctest: +SKIP
    2
    """
    total = 0
    for device in sorted(NEURON_SYSFS.glob("neuron[0-9]*")):
        try:
            total += int((device / "core_count").read_text().strip())
        except (OSError, ValueError):  # a device without a readable count adds none
            continue
    return total


class NeuronBackend(XlaBackend):
    name = "neuron"

    @classmethod
    def is_available(cls) -> bool:
        if neuron_core_count() == 0:
            return False
        try:
            import_torch_neuronx()
        except BackendUnavailableError:
            return False
        return True

    def start(self) -> None:
        import_torch_neuronx()
        if neuron_core_count() == 0:
            raise BackendError(
                f"backend 'neuron' found no NeuronCore: the Neuron driver lists none under "
                f"{NEURON_SYSFS}; run on a Trainium/Inferentia instance (trn1, trn2, inf2) with the "
                "Neuron driver installed, or use sw.init_backend('gloo') on CPUs"
            )
        super().start()
