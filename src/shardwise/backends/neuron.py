"""AWS Trainium/Inferentia: ``neuron``, the native TorchNeuron (torch-neuronx 2.10 and later:
device ``"neuron"``, DTensor), and ``neuron_xla``, the torch_xla-based torch-neuronx (2.9 and
earlier). One NeuronCore per process, no gather to one rank. Detection reads sysfs and package
metadata only: it never imports torch_neuronx nor starts the Neuron runtime."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

import torch

from shardwise.backends.base import Backend
from shardwise.backends.launch import torchrun_env
from shardwise.backends.xla import XlaBackend
from shardwise.errors import BackendError, BackendUnavailableError

NATIVE_FROM = (2, 10)  # torch-neuronx for torch 2.10 and later is TorchNeuron (no torch_xla)
_INDEX = "--extra-index-url https://pip.repos.neuron.amazonaws.com"
NEURON_HINT = (f"install TorchNeuron from the AWS Neuron package repository (pip install "
               f"-r backends/neuron/requirements.txt {_INDEX}); the package named torch-neuronx on "
               "PyPI is a placeholder")
NEURON_XLA_HINT = (f"install the torch_xla-based torch-neuronx from the AWS Neuron package repository "
                   f"(pip install -r backends/neuron_xla/requirements.txt {_INDEX}); the package named "
                   "torch-neuronx on PyPI is a placeholder")
# Where the Neuron driver lists its devices (tests point it at a fake tree)
NEURON_SYSFS = Path("/sys/devices/virtual/neuron_device")


def neuron_core_count() -> int:
    """NeuronCores the Neuron driver shows on this host, from sysfs (0 when it shows none).

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


def require_cores(backend: str, instances: str) -> None:
    """Raise ``BackendError`` for ``backend`` unless the Neuron driver shows a NeuronCore."""
    if neuron_core_count() == 0:
        raise BackendError(
            f"backend {backend!r} found no NeuronCore: the Neuron driver lists none under {NEURON_SYSFS}; "
            f"run on {instances} with the Neuron driver installed, or use sw.init_backend('gloo') on CPUs")


def torch_neuronx_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the installed torch-neuronx from its metadata, or None.

    >>> torch_neuronx_version()   # TorchNeuron 2.13.1  # doctest: +SKIP
    (2, 13)
    """
    try:
        text = importlib.metadata.version("torch-neuronx")
    except importlib.metadata.PackageNotFoundError:
        return None
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2])) if match else None


def is_native(version: tuple[int, int]) -> bool:
    """True for a torch-neuronx version that is TorchNeuron (torch 2.10 or later).

    >>> is_native((2, 13)), is_native((2, 9))
    (True, False)
    """
    return tuple(version) >= NATIVE_FROM


def import_torch_neuronx(backend: str = "neuron", *, hint: str = NEURON_HINT):
    """torch_neuronx, or ``BackendUnavailableError`` naming ``backend`` and ``hint``."""
    try:
        import torch_neuronx
    except Exception as e:  # the PyPI placeholder raises a non-ImportError on import
        raise BackendUnavailableError(
            f"backend {backend!r} needs torch_neuronx, which is not importable ({e}); {hint}"
        ) from e
    return torch_neuronx


def _installed() -> bool:
    try:
        return importlib.util.find_spec("torch_neuronx") is not None
    except (ImportError, ValueError):  # a broken or blocked entry in sys.modules
        return False


class NeuronBackend(Backend):
    name = "neuron"
    dist_backend = "neuron"
    device_type = "neuron"
    supports_dtensor = True
    supports_gather = False
    supports_p2p = False  # not documented for TorchNeuron's group: conservatively off, like gather
    supports_all_to_all = False  # as p2p
    _index = 0  # of this process's NeuronCore among those it sees (start() sets it)

    @classmethod
    def is_available(cls) -> bool:
        version = torch_neuronx_version()
        return version is not None and is_native(version) and neuron_core_count() > 0 and _installed()

    def start(self) -> None:
        version = torch_neuronx_version()
        if not _installed():
            import_torch_neuronx()  # raises, saying what to install
        if version is not None and not is_native(version):
            raise BackendUnavailableError(
                f"backend 'neuron' is TorchNeuron (torch-neuronx 2.13 or later), but torch-neuronx "
                f"{'.'.join(map(str, version))} is installed: the torch_xla-based one (use "
                f"sw.init_backend('neuron_xla')) or PyPI's placeholder; {NEURON_HINT}"
            )
        require_cores("neuron", "a Trainium instance (trn2, trn3)")
        import_torch_neuronx()  # registers the "neuron" device and process group backend
        module = getattr(torch, "neuron", None)
        count = int(module.device_count()) if module is not None else 0
        if count == 0:
            raise BackendError(
                "torch_neuronx is imported but torch.neuron sees no device: is this TorchNeuron "
                f"(torch-neuronx 2.13 or later) and may this process use a NeuronCore? {NEURON_HINT}"
            )
        env = torchrun_env()
        local_rank = env["local_rank"] if env else 0
        # One process per NeuronCore, as on CUDA: LOCAL_RANK picks it among those this process
        # sees, unless the runtime shows each process only its own (index 0).
        if count > 1:
            if local_rank >= count:
                raise BackendError(f"LOCAL_RANK={local_rank} but this process sees only {count} "
                                   "NeuronCore(s); launch at most one process per NeuronCore")
            self._index = local_rank
            assert module is not None  # count > 0: torch.neuron exists
            module.set_device(local_rank)
        super().start()

    def _device(self) -> torch.device:
        return torch.device(self.device_type, self._index)


# The torch_xla-based torch-neuronx: torch 2.9 was the last (backends/neuron_xla/requirements.txt).
REQUIREMENT = "torch-neuronx<2.10"


def import_torch_neuronx_xla():
    """The torch_xla-based torch_neuronx, or ``BackendUnavailableError``."""
    version = torch_neuronx_version()
    if version is not None and is_native(version):
        raise BackendUnavailableError(
            f"backend 'neuron_xla' needs the torch_xla-based torch-neuronx ({REQUIREMENT}), but "
            f"torch-neuronx {'.'.join(map(str, version))} is the native TorchNeuron: use "
            "sw.init_backend('neuron'), or install backends/neuron_xla/requirements.txt in another "
            "environment"
        )
    return import_torch_neuronx("neuron_xla", hint=NEURON_XLA_HINT)


class NeuronXlaBackend(XlaBackend):
    name = "neuron_xla"

    @classmethod
    def is_available(cls) -> bool:
        if neuron_core_count() == 0:
            return False
        try:
            import_torch_neuronx_xla()
        except BackendUnavailableError:
            return False
        return True

    def start(self) -> None:
        import_torch_neuronx_xla()
        require_cores("neuron_xla", "a Trainium/Inferentia instance (trn1, inf2)")
        super().start()
