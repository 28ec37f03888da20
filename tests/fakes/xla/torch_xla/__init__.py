"""A fake torch_xla for the CPU suite: torch_xla 2.9 as it behaves where shardwise touches it,
on PJRT CPU unless a fake runtime says otherwise (``runtime.py``).

Its device is a real XLA-type device whose memory is host memory (``fakes.device``, a built C++
extension whose path is in ``SHARDWISE_FAKE_DEVICE_LIB``), so a CPU tensor sent where torch_xla
takes XLA tensors is caught; its ``xla`` process group (``distributed/xla_backend.py``) is
``fakes.device.groups.XlaGroup``: a no-op all_reduce for CPU tensors and for a group larger than
the runtime's world, other collectives of CPU tensors refused, work that refuses a finite wait.
``device_calls`` counts ``device()`` calls, so a test can tell where a backend's device came from.
"""

import sys
from pathlib import Path

import torch

_TESTS = str(Path(__file__).resolve().parents[3])  # tests/: the fakes package
if _TESTS not in sys.path:
    sys.path.append(_TESTS)

FAKE = True
device_calls = 0


def device(index=None):
    global device_calls
    from fakes import device as host

    host.load()
    device_calls += 1
    return torch.device("xla", 0)


def devices():
    return [device()]


def sync():
    """Nothing is lazy here: every op ran when it was issued."""
