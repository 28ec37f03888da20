"""Host-to-device copies for the loaders. On an accelerator (CUDA) through a few reused pinned
buffers, on a side stream: a reader thread copies its fresh tensor into a free pinned buffer,
queues the DMA from it on the side stream, records the buffer's event and goes back to reading
while the copy runs; a buffer is written again only once the host has seen its event pass.
:meth:`PinnedStager.join` makes the consumer's stream wait for the side stream: the load calls
it before installing (and before anything reads the tensors). Elsewhere (CPU, gloo) a plain
``.to(device)``, no stream, nothing to join.

The device calls go through :class:`DeviceCopies` (six methods), so a fake can stand in for
CUDA on the CPU suite and fail where CUDA would (tests/unit/test_staging.py)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from shardwise.errors import UsageError

STAGE_BYTES = 32 << 20  # one pinned buffer
NUM_BUFFERS = 4         # buffers a load may pin (allocated as the reader threads need them)


class DeviceCopies(Protocol):
    """What :class:`PinnedStager` asks of a device: ``pinned`` buffers and their ``event``s as it
    needs them, one ``side_stream``; per tensor ``empty`` (its place on the device), then per
    piece ``host_wait`` on the buffer's event, ``fill`` the buffer, ``copy_async`` from it on the
    side stream (recording the buffer's event after the copy); at the end ``join``. Called from
    the reader threads at once: an implementation is thread-safe."""

    def pinned(self, nbytes: int) -> torch.Tensor: ...            # page-locked host bytes (uint8)
    def empty(self, like: torch.Tensor) -> torch.Tensor: ...       # like's shape and dtype, on the device
    def side_stream(self) -> Any: ...
    def event(self) -> Any: ...
    def host_wait(self, event: Any) -> None: ...                   # the host blocks until it passed
    def fill(self, buf: torch.Tensor, src: torch.Tensor) -> None: ...  # host bytes into a pinned buffer
    def copy_async(self, dst: torch.Tensor, buf: torch.Tensor, stream: Any, event: Any) -> None: ...
    def join(self, stream: Any) -> None: ...                       # the consumer's stream waits for it


class CudaCopies:
    """:class:`DeviceCopies` on one CUDA device."""

    def __init__(self, device: torch.device):
        self.device = device

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def empty(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device=self.device)

    def side_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def event(self) -> Any:
        return torch.cuda.Event()

    def host_wait(self, event: Any) -> None:
        event.synchronize()  # an event never recorded has passed

    def fill(self, buf: torch.Tensor, src: torch.Tensor) -> None:
        buf.copy_(src)

    def copy_async(self, dst: torch.Tensor, buf: torch.Tensor, stream: Any, event: Any) -> None:
        # dst was made on the consumer's stream: the allocator must not hand its memory out
        # again before the side stream's copy into it is done
        dst.record_stream(stream)
        with torch.cuda.stream(stream):
            dst.copy_(buf, non_blocking=True)
        event.record(stream)

    def join(self, stream: Any) -> None:
        torch.cuda.current_stream(self.device).wait_stream(stream)


class PlainCopy:
    """``tensor.to(device)``: a device with no stream to overlap on (CPU, or no accelerator)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device)

    def join(self) -> None:
        """Nothing in flight."""


def host_to_device(device: torch.device) -> PinnedStager | PlainCopy:
    """A callable copying a CPU tensor to ``device`` (:class:`PinnedStager` for CUDA), with a
    ``join()`` to call before the tensors are used.

    >>> move = host_to_device(torch.device("cpu"))
    >>> move(torch.ones(2)).device
    device(type='cpu')
    """
    if device.type == "cuda" and torch.cuda.is_available():
        return PinnedStager(device)
    return PlainCopy(device)


class PinnedStager:
    """Copies CPU tensors to one device through at most ``num_buffers`` pinned buffers of
    ``buffer_bytes`` on a side stream; thread-safe. A returned tensor may still be in flight
    until :meth:`join`. ``copies``: the device's calls (default :class:`CudaCopies`)."""

    def __init__(self, device: torch.device, *, buffer_bytes: int = STAGE_BYTES,
                 num_buffers: int = NUM_BUFFERS, copies: DeviceCopies | None = None):
        if buffer_bytes < 1 or num_buffers < 1:
            raise UsageError(f"PinnedStager: buffer_bytes and num_buffers must be positive, got "
                             f"buffer_bytes={buffer_bytes}, num_buffers={num_buffers}; leave them at "
                             f"their defaults ({STAGE_BYTES} and {NUM_BUFFERS})")
        self.device, self.buffer_bytes, self.num_buffers = device, buffer_bytes, num_buffers
        self.copies: DeviceCopies = copies if copies is not None else CudaCopies(device)
        self._free: queue.Queue = queue.Queue()
        self._made = 0
        self._stream: Any = None
        self._lock = threading.Lock()

    def _take(self) -> tuple[torch.Tensor, Any]:
        with self._lock:
            if self._free.empty() and self._made < self.num_buffers:
                self._made += 1
                return self.copies.pinned(self.buffer_bytes), self.copies.event()
        return self._free.get()

    def _side(self) -> Any:
        with self._lock:
            if self._stream is None:
                self._stream = self.copies.side_stream()
            return self._stream

    def __call__(self, src: torch.Tensor) -> torch.Tensor:
        """``src`` on the device, its copy possibly still in flight (see :meth:`join`)."""
        dst = self.copies.empty(src)
        nbytes = src.numel() * src.element_size()
        if nbytes == 0:
            return dst
        src_bytes = src.contiguous().reshape(-1).view(torch.uint8)
        dst_bytes = dst.reshape(-1).view(torch.uint8)
        stream = self._side()
        for lo in range(0, nbytes, self.buffer_bytes):
            hi = min(nbytes, lo + self.buffer_bytes)
            buf, done = self._take()
            try:
                self.copies.host_wait(done)  # the buffer's previous copy has left it
                self.copies.fill(buf[: hi - lo], src_bytes[lo:hi])
                self.copies.copy_async(dst_bytes[lo:hi], buf[: hi - lo], stream, done)
            finally:
                self._free.put((buf, done))
        return dst

    def join(self) -> None:
        """The consumer's stream waits for every copy queued so far (call it before the tensors
        are read or installed; the host does not block)."""
        with self._lock:
            stream = self._stream
        if stream is not None:
            self.copies.join(stream)


def loaded_dtype(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The one cast rule of every load: a floating tensor stored as ``stored`` loads as
    ``dtype``; anything else (every tensor when ``dtype`` is None) keeps its stored dtype.

    >>> loaded_dtype(torch.float32, torch.bfloat16), loaded_dtype(torch.int64, torch.bfloat16)
    (torch.bfloat16, torch.int64)
    """
    return dtype if dtype is not None and stored.is_floating_point else stored


def cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in its :func:`loaded_dtype` (``t`` itself when that is its dtype already)."""
    want = loaded_dtype(t.dtype, dtype)
    return t if t.dtype == want else t.to(want)


def finalizer(dtype: torch.dtype | None, device: torch.device,
              to_device: Callable[[torch.Tensor], torch.Tensor] | None = None
              ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Cast (:func:`loaded_dtype`) and move a freshly read tensor: a narrowing cast before the
    copy to ``device`` (by ``to_device``, default :func:`host_to_device`'s), a widening one after."""
    to_device = to_device if to_device is not None else host_to_device(device)

    def finalize(raw: torch.Tensor) -> torch.Tensor:
        convert = loaded_dtype(raw.dtype, dtype) != raw.dtype
        if convert and dtype is not None and dtype.itemsize <= raw.dtype.itemsize:  # convert: dtype is set
            raw, convert = raw.to(dtype), False
        raw = to_device(raw) if raw.device != device else raw
        return raw.to(dtype) if convert else raw

    return finalize


__all__ = ["CudaCopies", "DeviceCopies", "NUM_BUFFERS", "PinnedStager", "PlainCopy", "STAGE_BYTES", "cast",
           "finalizer", "host_to_device", "loaded_dtype"]
