"""Process groups for the fake host device (``fakes.device``), each accepting exactly what the
real group it stands for accepts. Collectives travel over an inner gloo group through host copies.

- :class:`DeviceGroup`: a group registered for ONE device type, as NCCL is for CUDA (and as
  ``init_process_group("cuda:gloo")`` is): a tensor of another device type, a CPU tensor in
  particular, fails with c10d's own message "No backend type associated with device type cpu".
  Collectives are asynchronous and ``work.wait(timeout)`` is bounded, as NCCL's is.
- :class:`XlaGroup`: torch_xla's ``xla`` group (``ProcessGroupXla``) as the probe of issue 22
  found it: an all_reduce of CPU tensors is a silent no-op, any other collective of a CPU tensor
  fails (``Check failed: device.type() == at::kXLA``); XLA collectives run among the devices
  the PJRT runtime knows, so over a group larger than the runtime's world (an ``env://`` group
  on PJRT CPU, whose runtime is one process) an all_reduce is a silent no-op too and other
  collectives fail here (what they do there was not probed); every collective is finished when
  it returns and its work is torch's ``FutureWrappingWork``, whose ``wait`` refuses a finite
  timeout; the caller's timeout bounds nothing (the transport waits ``XLA_TRANSPORT_TIMEOUT``).

Register them with :func:`register_device_group` / :func:`register_xla_group` in the process
(rank) that uses them, before ``init_process_group``.
"""

from __future__ import annotations

import datetime as _dt

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

try:
    from torch._C._distributed_c10d import PythonCallbackWork
except ImportError:  # torch 2.9: a Python subclass of Work, whose wait c10d calls, does the same

    class PythonCallbackWork(dist.Work):  # type: ignore[no-redef]
        def __init__(self, callback):
            super().__init__()
            self._callback = callback

        def wait(self, timeout=_dt.timedelta(0)):
            return self._callback(timeout)

XLA_TRANSPORT_TIMEOUT = _dt.timedelta(minutes=10)  # what "no timeout" means here: the harness kills first


def _done(tensors) -> dist.Work:
    future = torch.futures.Future()
    future.set_result(tensors)
    return _create_work_from_future(future)


class _all:
    """Several gloo works (issued in order, as each rank issues them) waited as one."""

    def __init__(self, works):
        self._works = list(works)

    def wait(self, timeout=None):
        for work in self._works:
            work.wait(timeout) if timeout else work.wait()
        return True


class _HostTransport(dist.ProcessGroup):
    """Runs each collective on host copies over an inner gloo group, then writes results back.
    Subclasses say what the real group accepts: :meth:`_check` raises where it refuses a tensor,
    :meth:`_silent` is True where it does nothing and says nothing (an all_reduce only)."""

    def __init__(self, store, rank: int, size: int, timeout, *, device_type: str, name: str):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._device_type, self._name = device_type, name
        # Registered so that the group has a name and says which devices it takes; collectives
        # never reach it directly (every one is overridden below), and gloo would refuse them.
        self._register_backend(torch.device(device_type), dist.ProcessGroup.BackendType.CUSTOM, self._gloo)

    def getBackendName(self) -> str:
        return self._name

    def _check(self, *tensors: torch.Tensor) -> None:
        raise NotImplementedError

    def _silent(self, *tensors: torch.Tensor) -> bool:
        return False

    def _run(self, inputs, outputs, issue) -> dist.Work:
        """``issue(host_inputs, host_outputs)`` -> gloo work; results copied back on completion."""
        host_in = [[t.cpu() for t in group] for group in inputs]
        host_out = [[t.cpu() for t in group] for group in outputs]
        work = issue(host_in, host_out)
        return self._finish(work, outputs, host_out)

    def _finish(self, work, outputs, host_out) -> dist.Work:
        def complete(timeout: _dt.timedelta) -> bool:
            work.wait(timeout) if timeout else work.wait()
            for group, host in zip(outputs, host_out, strict=True):
                for t, h in zip(group, host, strict=True):
                    t.copy_(h)
            return True

        return PythonCallbackWork(complete)

    # -- the collectives shardwise, DTensor and FSDP2 issue ---------------------------------
    def allreduce(self, tensors, opts):
        if self._silent(*tensors):
            return _done(tensors)
        self._check(*tensors)
        return self._run([tensors], [tensors], lambda i, o: self._gloo.allreduce(o[0], opts))

    def allreduce_coalesced(self, tensors, opts=None):
        if self._silent(*tensors):
            return _done(tensors)
        self._check(*tensors)
        return self._run([tensors], [tensors], lambda i, o: self._gloo.allreduce_coalesced(
            o[0], opts or dist.AllreduceCoalescedOptions()))

    def broadcast(self, tensors, opts):
        self._check(*tensors)
        return self._run([tensors], [tensors], lambda i, o: self._gloo.broadcast(o[0], opts))

    def allgather(self, output_lists, inputs, opts=None):
        self._check(*inputs, *(t for group in output_lists for t in group))
        return self._run([inputs], output_lists,
                         lambda i, o: self._gloo.allgather(o, i[0], opts or dist.AllgatherOptions()))

    def _allgather_base(self, output, inp, opts=None):
        self._check(output, inp)
        return self._run([[inp]], [[output]], lambda i, o: self._gloo._allgather_base(
            o[0][0], i[0][0], opts or dist.AllgatherOptions()))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        self._check(*outputs, *inputs)
        return self._run([inputs], [outputs], lambda i, o: _all(
            self._gloo._allgather_base(out, inp, opts or dist.AllgatherOptions())
            for out, inp in zip(o[0], i[0], strict=True)))

    def _reduce_scatter_base(self, output, inp, opts=None):
        self._check(output, inp)
        return self._run([[inp]], [[output]], lambda i, o: self._gloo._reduce_scatter_base(
            o[0][0], i[0][0], opts or dist.ReduceScatterOptions()))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        self._check(*outputs, *inputs)
        return self._run([inputs], [outputs], lambda i, o: _all(
            self._gloo._reduce_scatter_base(out, inp, opts or dist.ReduceScatterOptions())
            for out, inp in zip(o[0], i[0], strict=True)))

    def reduce_scatter(self, outputs, input_lists, opts=None):
        self._check(*outputs, *(t for group in input_lists for t in group))
        return self._run(input_lists, [outputs], lambda i, o: self._gloo.reduce_scatter(
            o[0], i, opts or dist.ReduceScatterOptions()))

    def gather(self, output_lists, inputs, opts):
        self._check(*inputs, *(t for group in output_lists for t in group))
        return self._run([inputs], output_lists, lambda i, o: self._gloo.gather(o, i[0], opts))

    def scatter(self, outputs, input_lists, opts):
        self._check(*outputs, *(t for group in input_lists for t in group))
        return self._run(input_lists, [outputs], lambda i, o: self._gloo.scatter(o[0], i, opts))

    def alltoall_base(self, output, inp, output_split_sizes, input_split_sizes, opts=None):
        self._check(output, inp)
        return self._run([[inp]], [[output]], lambda i, o: self._gloo.alltoall_base(
            o[0][0], i[0][0], output_split_sizes, input_split_sizes, opts or dist.AllToAllOptions()))

    def send(self, tensors, dst, tag):
        self._check(*tensors)
        return self._run([tensors], [], lambda i, o: self._gloo.send(i[0], dst, tag))

    def recv(self, tensors, src, tag):
        self._check(*tensors)
        return self._run([], [tensors], lambda i, o: self._gloo.recv(o[0], src, tag))

    # torch calls these names for all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    def barrier(self, opts=None):
        return self._finish(self._gloo.barrier(opts or dist.BarrierOptions()), [], [])


class DeviceGroup(_HostTransport):
    """A group that moves tensors of one device type only (NCCL: CUDA)."""

    def _check(self, *tensors):
        for t in tensors:
            if t.device.type != self._device_type:
                # c10d's own message, from ProcessGroup::getBackend, for a device it has no backend for
                raise RuntimeError(f"No backend type associated with device type {t.device.type}")


class XlaGroup(_HostTransport):
    """torch_xla's ``xla`` process group, as found on torch_xla 2.9 (see the module doc)."""

    def __init__(self, store, rank, size, timeout, **kwargs):
        super().__init__(store, rank, size, XLA_TRANSPORT_TIMEOUT, device_type="xla", name="xla")

    def _reached(self) -> bool:
        import torch_xla.runtime as xr

        return int(xr.world_size()) >= self.size()

    def _silent(self, *tensors):
        return not (all(t.device.type == "xla" for t in tensors) and self._reached())

    def _check(self, *tensors):
        for t in tensors:
            if t.device.type != "xla":
                raise RuntimeError(f"Check failed: device.type() == at::kXLA ({t.device.type} vs. xla)")
        if not self._reached():
            import torch_xla.runtime as xr

            raise RuntimeError(f"fake torch_xla: the PJRT runtime's world has {xr.world_size()} device(s), "
                               f"this group {self.size()} ranks")

    def _finish(self, work, outputs, host_out):
        # Finished when it returns (the collective is an op of the lazy graph): the work wraps a
        # completed future and refuses a finite wait, as torch_xla's does.
        work.wait()
        for group, host in zip(outputs, host_out, strict=True):
            for t, h in zip(group, host, strict=True):
                t.copy_(h)
        return _done([t for group in outputs for t in group])


def register_device_group(name: str, device_type: str) -> None:
    """Make ``init_process_group(name)`` build a :class:`DeviceGroup` for ``device_type`` only."""
    if name in dist.Backend.backend_list:
        return

    def create(store, rank, size, timeout):
        return DeviceGroup(store, rank, size, timeout, device_type=device_type, name=name)

    dist.Backend.register_backend(name, create, devices=[device_type])


def register_xla_group() -> None:
    """Make ``init_process_group("xla")`` build an :class:`XlaGroup`."""
    if "xla" in dist.Backend.backend_list:
        return
    dist.Backend.register_backend("xla", lambda store, rank, size, timeout: XlaGroup(
        store, rank, size, timeout), devices=["xla"])


__all__ = ["DeviceGroup", "XlaGroup", "register_device_group", "register_xla_group"]
