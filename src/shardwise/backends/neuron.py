"""AWS Trainium/Inferentia through torch-neuronx, which builds on torch_xla.

Neuron devices appear as XLA devices; the process group is torch_xla's. What differs
is detection (torch_neuronx must import and see a NeuronCore) and the install hint.
torch_neuronx is imported only inside functions.
"""

from __future__ import annotations

from shardwise.backends.xla import XlaBackend
from shardwise.errors import BackendUnavailableError

NEURON_HINT = ("install torch-neuronx from the AWS Neuron package repository "
               "(pip install 'shardwise[neuron]' --extra-index-url https://pip.repos.neuron.amazonaws.com); "
               "the package of that name on PyPI is a placeholder")


def import_torch_neuronx():
    try:
        import torch_neuronx
    except Exception as e:  # the PyPI placeholder raises a non-ImportError on import
        raise BackendUnavailableError(
            f"backend 'neuron' needs torch_neuronx, which is not importable ({e}); {NEURON_HINT}"
        ) from e
    return torch_neuronx


def neuron_core_count() -> int:
    """NeuronCores torch_neuronx reports (0 when it reports none or cannot tell)."""
    tn = import_torch_neuronx()
    for probe in ("xla_impl.data_parallel.device_count",):
        obj = tn
        try:
            for part in probe.split("."):
                obj = getattr(obj, part)
            return int(obj())
        except (AttributeError, TypeError, ValueError, RuntimeError):
            continue
    try:
        import torch_xla.runtime as xr

        return int(xr.global_runtime_device_count()) if xr.device_type() == "NEURON" else 0
    except Exception:  # no torch_xla runtime reachable: no device
        return 0


class NeuronBackend(XlaBackend):
    name = "neuron"

    @classmethod
    def is_available(cls) -> bool:
        try:
            return neuron_core_count() > 0
        except BackendUnavailableError:
            return False

    def start(self) -> None:
        import_torch_neuronx()
        super().start()
