"""Host-to-device copies for the loaders: on CUDA through a few reused pinned buffers (a DMA
while the readers go on; a buffer is reused once the event behind its copy has passed), a
plain ``.to(device)`` elsewhere. Copies are ordered on the device's current stream."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from shardwise.errors import UsageError

STAGE_BYTES = 32 << 20  # one pinned buffer
NUM_BUFFERS = 4         # buffers a load may pin (allocated as the reader threads need them)


def host_to_device(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function copying a CPU tensor to ``device`` (:class:`PinnedStager` for CUDA).

    >>> move = host_to_device(torch.device("cpu"))
    >>> move(torch.ones(2)).device
    device(type='cpu')
    """
    if device.type == "cuda" and torch.cuda.is_available():
        return PinnedStager(device)
    return lambda tensor: tensor.to(device)


class PinnedStager:
    """Copies CPU tensors to one CUDA device through at most ``num_buffers`` pinned buffers of
    ``buffer_bytes``; thread-safe."""

    def __init__(self, device: torch.device, *, buffer_bytes: int = STAGE_BYTES,
                 num_buffers: int = NUM_BUFFERS):
        if buffer_bytes < 1 or num_buffers < 1:
            raise UsageError(f"PinnedStager: buffer_bytes and num_buffers must be positive, got "
                             f"buffer_bytes={buffer_bytes}, num_buffers={num_buffers}; leave them at "
                             f"their defaults ({STAGE_BYTES} and {NUM_BUFFERS})")
        self.device, self.buffer_bytes, self.num_buffers = device, buffer_bytes, num_buffers
        self._free: queue.Queue = queue.Queue()
        self._made = 0
        self._lock = threading.Lock()

    def _take(self):
        with self._lock:
            if self._free.empty() and self._made < self.num_buffers:
                self._made += 1
                return (torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=True),
                        torch.cuda.Event())
        return self._free.get()

    def __call__(self, src: torch.Tensor) -> torch.Tensor:
        """``src`` on the device (the copy may still be in flight, see the module doc)."""
        dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        nbytes = src.numel() * src.element_size()
        if nbytes == 0:
            return dst
        src_bytes = src.contiguous().reshape(-1).view(torch.uint8)
        dst_bytes = dst.reshape(-1).view(torch.uint8)
        stream = torch.cuda.current_stream(self.device)
        for lo in range(0, nbytes, self.buffer_bytes):
            hi = min(nbytes, lo + self.buffer_bytes)
            buf, done = self._take()
            try:
                done.synchronize()  # the buffer's previous copy has left it
                buf[: hi - lo].copy_(src_bytes[lo:hi])
                with torch.cuda.stream(stream):
                    dst_bytes[lo:hi].copy_(buf[: hi - lo], non_blocking=True)
                done.record(stream)
            finally:
                self._free.put((buf, done))
        return dst


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


def finalizer(dtype: torch.dtype | None, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Cast (:func:`loaded_dtype`) and move a freshly read tensor: a narrowing cast before the
    copy to ``device``, a widening one after."""
    to_device = host_to_device(device)

    def finalize(raw: torch.Tensor) -> torch.Tensor:
        convert = loaded_dtype(raw.dtype, dtype) != raw.dtype
        if convert and dtype is not None and dtype.itemsize <= raw.dtype.itemsize:  # convert: dtype is set
            raw, convert = raw.to(dtype), False
        raw = to_device(raw) if raw.device != device else raw
        return raw.to(dtype) if convert else raw

    return finalize


__all__ = ["NUM_BUFFERS", "PinnedStager", "STAGE_BYTES", "cast", "finalizer", "host_to_device",
           "loaded_dtype"]
