"""The fake torch_xla.runtime: the process layout as the PJRT runtime sees it, NOT the launcher's.

On PJRT CPU (what this fakes unless told otherwise) every process is ordinal 0 of a world of one,
whatever torchrun says: torch_xla 2.9 has no multi-process CPU collectives. A runtime that sees
the whole job (a TPU pod, NeuronCores under the Neuron PJRT plugin) is faked by setting
``FAKE_PJRT_WORLD_SIZE`` / ``FAKE_PJRT_ORDINAL`` / ``FAKE_PJRT_LOCAL_ORDINAL``, which the fake
torch_neuronx does on import from the launcher's variables, as the real plugin learns the job.
"""

import os


def device_type():
    return os.environ.get("PJRT_DEVICE") or None


def world_size():
    return int(os.environ.get("FAKE_PJRT_WORLD_SIZE", "1"))


def global_ordinal():
    return int(os.environ.get("FAKE_PJRT_ORDINAL", "0"))


def local_ordinal():
    return int(os.environ.get("FAKE_PJRT_LOCAL_ORDINAL", "0"))


def process_count():
    return world_size()  # one device per process


def is_spmd():
    return False
