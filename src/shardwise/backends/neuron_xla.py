"""AWS Trainium/Inferentia through the torch_xla-based torch-neuronx (torch 2.9 and earlier,
Trn1/Inf2); the native TorchNeuron is ``neuron.py``. Each NeuronCore is an XLA device, one
process per NeuronCore under torchrun, ``init_process_group("xla")``: everything but detection
and the messages is the xla backend. Detection never starts the Neuron runtime (it would claim
the NeuronCores before torch_xla's rendezvous) and never imports a native TorchNeuron.
"""

from __future__ import annotations

from shardwise.backends import neuron
from shardwise.backends.xla import XlaBackend
from shardwise.errors import BackendError, BackendUnavailableError

# The torch_xla-based torch-neuronx: torch 2.9 was the last (backends/neuron_xla/requirements.txt).
REQUIREMENT = "torch-neuronx<2.10"


def import_torch_neuronx_xla():
    """The torch_xla-based torch_neuronx, or ``BackendUnavailableError`` saying what to install."""
    version = neuron.torch_neuronx_version()
    if version is not None and neuron.is_native(version):
        raise BackendUnavailableError(
            f"backend 'neuron_xla' needs the torch_xla-based torch-neuronx ({REQUIREMENT}), but "
            f"torch-neuronx {'.'.join(map(str, version))} is the native TorchNeuron: use "
            "sw.init_backend('neuron'), or install backends/neuron_xla/requirements.txt in another "
            "environment"
        )
    return neuron.import_torch_neuronx("neuron_xla", hint=neuron.NEURON_XLA_HINT)


class NeuronXlaBackend(XlaBackend):
    name = "neuron_xla"

    @classmethod
    def is_available(cls) -> bool:
        if neuron.neuron_core_count() == 0:
            return False
        try:
            import_torch_neuronx_xla()
        except BackendUnavailableError:
            return False
        return True

    def start(self) -> None:
        import_torch_neuronx_xla()
        if neuron.neuron_core_count() == 0:
            raise BackendError(
                f"backend 'neuron_xla' found no NeuronCore: the Neuron driver lists none under "
                f"{neuron.NEURON_SYSFS}; run on a Trainium/Inferentia instance (trn1, inf2) with the "
                "Neuron driver installed, or use sw.init_backend('gloo') on CPUs"
            )
        super().start()
