"""A device for the CPU suite whose memory is host memory, and process groups that move only
that device's tensors: stand-ins for hardware that fail where the hardware fails.

- ``host_device.cpp`` (a C++ extension, built once per source and torch version by
  :func:`build`) gives two real non-CPU device types backed by host memory: PrivateUse1
  (renamed by :func:`use_privateuse1`, e.g. to ``"neuron"`` as TorchNeuron does) and XLA (what
  torch_xla tensors report). Every op runs through torch's CPU kernels; a CPU tensor is still a
  CPU tensor, so code that forgets to move one to the device is caught.
- :mod:`fakes.device.groups`: ``DeviceGroup``, a process group registered for one device type
  only, as NCCL is for CUDA: a CPU tensor fails with c10d's own "No backend type associated with
  device type cpu"; and ``XlaGroup``, torch_xla's "xla" group as it behaves (see there).

The extension is built in the test process's first use (about 20 s on two cores, cached under
``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``); ranks and subprocesses load the
built library from the path in ``SHARDWISE_FAKE_DEVICE_LIB``. Building needs a C++ compiler;
:func:`build` raises ``RuntimeError`` saying so where there is none.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import types
from pathlib import Path

LIB_ENV = "SHARDWISE_FAKE_DEVICE_LIB"
SOURCE = Path(__file__).with_name("host_device.cpp")
NAME = "shardwise_host_device"


def _build_dir() -> Path:
    import torch

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    return Path(root) / f"{NAME}_torch{torch.__version__.replace('+', '_')}"


_built: str | None = None


def build() -> str:
    """The path of the built library (building it first if needed), also put in
    ``SHARDWISE_FAKE_DEVICE_LIB`` for the processes this one starts. Builds in a subprocess, so
    that the calling process (pytest's) never loads the fake device itself."""
    global _built
    if _built is not None:
        return _built
    out = _build_dir()
    out.mkdir(parents=True, exist_ok=True)
    code = ("import sys, torch.utils.cpp_extension as ext; "
            f"ext.load(name={NAME!r}, sources=[{str(SOURCE)!r}], build_directory={str(out)!r}, "
            "is_python_module=False, extra_cflags=['-O1'], verbose=False)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    lib = out / f"{NAME}.so"
    if proc.returncode != 0 or not lib.exists():
        raise RuntimeError(f"could not build the fake host device ({SOURCE.name}); it needs a C++ compiler "
                           f"and torch's headers:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    _built = os.environ[LIB_ENV] = str(lib)
    return _built


def require() -> str:
    """:func:`build` for a test: skips it, saying why, where nothing can build the library."""
    import shutil

    import pytest

    missing = [tool for tool in (os.environ.get("CXX", "c++"), "ninja") if shutil.which(tool) is None]
    if missing and not os.environ.get(LIB_ENV):
        pytest.skip(f"the fake host device (tests/fakes/device) needs {' and '.join(missing)} to build")
    return os.environ.get(LIB_ENV) or build()


_loaded = False


def load(lib: str | None = None) -> None:
    """Load the fake device into this process (idempotent): the XLA device type works from here
    on, and PrivateUse1 once :func:`use_privateuse1` names it."""
    global _loaded
    if _loaded:
        return
    import torch

    path = lib or os.environ.get(LIB_ENV)
    if not path:
        raise RuntimeError(f"the fake device library is not built: set {LIB_ENV} to the path that "
                           "fakes.device.build() returns")
    torch.ops.load_library(path)
    _loaded = True


def use_privateuse1(name: str, lib: str | None = None) -> None:
    """Name PrivateUse1 ``name`` (``torch.device(name)``, ``tensor.to(name)``, ``torch.<name>``),
    as an out-of-tree backend such as TorchNeuron does on import. Once per process."""
    import torch

    load(lib)
    if getattr(torch, name, None) is not None:
        return
    module = types.ModuleType(f"torch.{name}")
    module.is_available = lambda: True
    module.device_count = lambda: 1
    module.current_device = lambda: 0
    module.set_device = lambda device: None
    module.is_initialized = lambda: True
    module._is_in_bad_fork = lambda: False
    module.manual_seed = module.manual_seed_all = lambda seed: None
    module.synchronize = lambda device=None: None
    # Streams and events (FSDP2 orders its copies with them): the host device has one stream and
    # its events are complete when recorded (host_device.cpp's guard).
    module.Stream = lambda device=None, priority=0, **kwargs: torch.Stream(device=name, priority=priority)
    module.current_stream = lambda device=None: torch.Stream(device=name)
    module.default_stream = module.current_stream
    module.stream = lambda stream=None: contextlib.nullcontext()
    module.Event = lambda **kwargs: torch.Event(device=name, **kwargs)
    torch.utils.rename_privateuse1_backend(name)
    torch._register_device_module(name, module)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)


__all__ = ["LIB_ENV", "build", "load", "require", "use_privateuse1"]
