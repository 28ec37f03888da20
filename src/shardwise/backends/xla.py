"""TPU (and other PJRT devices) through torch_xla, one process per device; ``neuron_xla`` builds
on it. Process group ``xla`` plus a gloo ``coordination_group``; a ``GroupMesh``; local holding;
collective timeouts are not honoured (``timeout=`` bounds only the start)."""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist

from shardwise.backends.base import Backend, torchrun_env
from shardwise.backends.group_mesh import AxisMesh, GroupMesh
from shardwise.errors import BackendError, BackendUnavailableError, CollectiveError

XLA_HINT = "pip install 'shardwise[xla]' (torch-xla must match your torch version)"
TIMEOUT_LIMIT = (
    "torch_xla's 'xla' process group finishes a collective when it is issued (it is an op of the lazy "
    "graph, run later on the device) and its work objects refuse a finite wait, so no collective "
    "can be bounded: a peer that never comes blocks the graph's execution until the runtime's own "
    "limits end the job"
)


def import_torch_xla():
    """torch_xla, or BackendUnavailableError with the install hint."""
    try:
        import torch_xla
        import torch_xla.runtime  # noqa: F401
    except ImportError as e:
        raise BackendUnavailableError(
            f"backend 'xla' needs torch_xla, which is not importable ({e}); {XLA_HINT}"
        ) from e
    return torch_xla


def spmd_enabled() -> bool:
    """True when this process already imported torch_xla and called ``xr.use_spmd()``."""
    if sys.modules.get("torch_xla") is None:
        return False
    try:
        import torch_xla.runtime as xr

        return bool(xr.is_spmd())
    except Exception:  # a torch_xla that cannot answer has no SPMD turned on
        return False


class XlaBackend(Backend):
    name = "xla"
    dist_backend = "xla"
    device_type = "xla"
    supports_dtensor = False
    supports_gather = False
    supports_p2p = False  # torch_xla's process group implements no isend / irecv
    supports_all_to_all = False  # nor an all_to_all with uneven splits

    timeout_limit = TIMEOUT_LIMIT

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._side_group = None
        if kwargs.get("timeout") is not None:
            warnings.warn(
                f"backend {self.name!r} cannot honour timeout={kwargs['timeout']!r} for collectives: "
                f"{TIMEOUT_LIMIT}. It still bounds joining the process group and the gloo side group "
                "(DCP, object collectives)", stacklevel=3)

    @classmethod
    def is_available(cls) -> bool:
        try:
            import torch_xla.runtime as xr

            # device_type() only reads PJRT_DEVICE: asking for a device count here would start
            # the PJRT client before torch_xla's rendezvous assigns this process its device.
            # NeuronCores are the neuron backend's to claim.
            return xr.device_type() not in (None, "", "NEURON")
        except Exception:  # any failure to reach a PJRT device means "not here"
            return False

    def start(self) -> None:
        import_torch_xla()
        if spmd_enabled():
            raise BackendError(
                "torch_xla SPMD mode is on in this process (xr.use_spmd() was called), where one "
                "process drives every device and the 'xla' process group cannot run; use "
                "sw.init_backend('xla_spmd')"
            )
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers "xla" and xla://)

        super().start()
        env = torchrun_env()
        if env is None:
            import torch_xla.runtime as xr

            self.local_rank = int(xr.local_ordinal())
        # Every rank creates it, right after the default group: new_group is collective.
        self._side_group = dist.new_group(backend="gloo")

    def _init_group(self) -> None:
        import torch_xla.runtime as xr

        try:
            if torchrun_env() is None and int(xr.world_size()) == 1:
                # xla:// starts a TCPStore on MASTER_PORT (default 12355) and holds it, so two
                # single-device processes on one host would collide; a world of one needs none.
                dist.init_process_group("xla", store=dist.HashStore(), rank=0, world_size=1,
                                        timeout=self.timeout)
            else:
                dist.init_process_group("xla", init_method="xla://", timeout=self.timeout)
        except Exception as e:
            raise BackendError(f"could not start the xla process group: {e}; is PJRT_DEVICE set "
                               "(TPU, CPU, NEURON) and does every process see its device?") from e

    def _device(self) -> torch.device:
        return torch.device(import_torch_xla().device())

    def _make_mesh(self, names, shape) -> AxisMesh:
        return GroupMesh(self.device_type, names, shape, rank=self.rank, new_group=self._new_group)

    @staticmethod
    def _new_group(ranks: list[int]):
        from torch_xla.distributed.xla_backend import new_xla_process_group

        return new_xla_process_group(ranks)

    @property
    def coordination_group(self):
        return self._side_group

    def wait(self, work, what: str, *, timeout=None) -> None:
        # torch_xla's work objects refuse a finite wait timeout (TIMEOUT_LIMIT)
        try:
            work.wait()
        except Exception as e:  # torch raises RuntimeError subclasses
            raise CollectiveError(f"{what} on rank {self.rank} failed: {e}") from e

    def settle(self, tensors) -> None:
        settle(tensors)

    def shutdown(self) -> None:
        self._side_group = None  # destroy_process_group() in super() ends every group
        super().shutdown()


def settle(tensors) -> None:
    """Run every pending XLA operation as one program when any of ``tensors`` is an XLA tensor."""
    if any(isinstance(t, torch.Tensor) and t.device.type == "xla" for t in tensors):
        import torch_xla

        torch_xla.sync(wait=True)
