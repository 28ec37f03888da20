"""A fake torch_xla exposing only what shardwise's xla/neuron backends touch, for the CPU suite.

Its "xla" device is the CPU and its "xla" process group is gloo (``distributed/xla_backend``),
so the multi-process xla path (GroupMesh, side group, local holding, collectives in the
forward) runs on spawned CPU ranks. ``device_calls`` counts ``device()`` calls, so a test can
tell that the backend's device came from here.
"""

import torch

FAKE = True
device_calls = 0


def device(index=None):
    global device_calls
    device_calls += 1
    return torch.device("cpu")


def devices():
    return [device()]
