"""The accelerator load path's staging (io.staging.PinnedStager) on the CPU suite, through a fake
of CUDA's copies that fails where CUDA would: copies queued on a stream run only when something
waits for them (an event on the host, or a join), so a missing wait leaves the destination's
bytes unwritten; a non-blocking copy from memory that is not pinned raises (CUDA silently copies
synchronously: the overlap is lost); writing a pinned buffer whose last copy is still queued
raises (CUDA would copy the new bytes: silent corruption)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from shardwise.io.staging import PinnedStager

UNWRITTEN = 0xA5  # the bytes of device memory no copy has reached yet


class FakeEvent:
    def __init__(self) -> None:
        self.stream: FakeStream | None = None  # None: never recorded, so it has passed
        self.position = 0


class FakeStream:
    def __init__(self) -> None:
        self.queued: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (position, dst, pinned src)
        self.next = 0

    def run_until(self, position: int) -> None:
        while self.queued and self.queued[0][0] < position:
            _, dst, src = self.queued.pop(0)
            dst.copy_(src)


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


class FakeCopies:
    """``DeviceCopies`` on host memory with CUDA's rules (see the module doc)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pinned_spans: list[tuple[int, int]] = []
        self.streams: list[FakeStream] = []
        self.copies = 0

    def pinned(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        with self.lock:
            self.pinned_spans.append(_span(buf))
        return buf

    def empty(self, like: torch.Tensor) -> torch.Tensor:
        out = torch.empty(like.shape, dtype=like.dtype)
        out.reshape(-1).view(torch.uint8).fill_(UNWRITTEN)
        return out

    def side_stream(self) -> FakeStream:
        with self.lock:
            self.streams.append(FakeStream())
            return self.streams[-1]

    def event(self) -> FakeEvent:
        return FakeEvent()

    def host_wait(self, event: FakeEvent) -> None:
        with self.lock:
            if event.stream is not None:
                event.stream.run_until(event.position)

    def fill(self, buf: torch.Tensor, src: torch.Tensor) -> None:
        lo, hi = _span(buf)
        with self.lock:
            for stream in self.streams:
                for _, _, queued in stream.queued:
                    qlo, qhi = _span(queued)
                    if lo < qhi and qlo < hi:
                        raise RuntimeError("a pinned staging buffer was written while a copy from it "
                                           "was still queued (CUDA would copy the new bytes)")
        buf.copy_(src)

    def copy_async(self, dst: torch.Tensor, buf: torch.Tensor, stream: FakeStream, event: FakeEvent) -> None:
        lo, hi = _span(buf)
        with self.lock:
            if not any(plo <= lo and hi <= phi for plo, phi in self.pinned_spans):
                raise RuntimeError("non_blocking copy from memory that is not pinned (CUDA would copy "
                                   "synchronously: the overlap with the reads is lost)")
            stream.queued.append((stream.next, dst, buf))
            stream.next += 1
            event.stream, event.position = stream, stream.next
            self.copies += 1

    def join(self, stream: FakeStream) -> None:
        with self.lock:
            stream.run_until(stream.next)


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(37, 29, generator=g), torch.randn(5000, generator=g).to(torch.bfloat16),
            torch.randint(0, 2, (999,), generator=g).bool(), torch.tensor(3.5, dtype=torch.float64),
            torch.empty(0, 4), torch.randint(-9, 9, (3, 70, 11), generator=g).to(torch.int8),
            torch.randn(64, 64, generator=g)[:, ::2]]  # non-contiguous


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8)

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def _stager(copies) -> PinnedStager:
    return PinnedStager(torch.device("cpu"), buffer_bytes=1000, num_buffers=2, copies=copies)  # many reuses


def test_staged_copies_are_byte_exact_after_join():
    copies = FakeCopies()
    stage = _stager(copies)
    with ThreadPoolExecutor(4) as pool:  # the reader's threads call it at once
        moved = list(pool.map(stage, _tensors() * 3))
    stage.join()
    assert all(_same_bytes(src, dst) for src, dst in zip(_tensors() * 3, moved, strict=True))
    assert stage._made <= 2 and copies.copies > 2 * 3  # buffers reused, pieces went through them


def test_before_join_the_copies_may_not_have_landed():
    """What the join in InstallPlacement.install is for: without it a reader sees device bytes
    no copy has reached (the fake runs a stream's copies only when something waits)."""
    stage = _stager(FakeCopies())
    src = torch.arange(100, dtype=torch.float32)  # 400 bytes: one piece, its buffer never waited on
    dst = stage(src)
    assert not _same_bytes(src, dst)
    stage.join()
    assert _same_bytes(src, dst)


def test_the_fake_refuses_what_cuda_gets_wrong():
    copies = FakeCopies()
    stream, event = copies.side_stream(), copies.event()
    with pytest.raises(RuntimeError, match="not pinned"):
        copies.copy_async(torch.empty(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8), stream, event)
    buf = copies.pinned(8)
    copies.fill(buf, torch.ones(8, dtype=torch.uint8))
    copies.copy_async(torch.empty(8, dtype=torch.uint8), buf, stream, event)
    with pytest.raises(RuntimeError, match="still queued"):
        copies.fill(buf[:4], torch.zeros(4, dtype=torch.uint8))
    copies.host_wait(event)
    copies.fill(buf, torch.zeros(8, dtype=torch.uint8))  # its copy has run: free again


def test_a_stager_that_skips_the_buffer_wait_is_caught():
    """One buffer, a tensor of several pieces: each piece reuses the buffer, so the stager's
    host_wait on the buffer's event is what keeps the fill from overwriting a queued copy."""
    copies = FakeCopies()
    copies.host_wait = lambda event: None  # type: ignore[method-assign]  # a stager that does not wait
    stage = PinnedStager(torch.device("cpu"), buffer_bytes=100, num_buffers=1, copies=copies)
    with pytest.raises(RuntimeError, match="still queued"):
        stage(torch.zeros(300, dtype=torch.uint8))


def _load_through_fake_staging() -> tuple[bool, int]:
    """A 2-rank load whose every read goes through PinnedStager over FakeCopies (the placement
    thinks the tensors go to a device), installed, then compared with the checkpoint's shards."""
    import tempfile

    import safetensors.torch as st
    from torch import nn

    import shardwise as sw
    import shardwise.io.place as place
    from shardwise.holding import local_of
    from shardwise.io.staging import cast

    backend = sw.init_backend("gloo")
    copies = FakeCopies()
    place.host_to_device = lambda device: PinnedStager(device, buffer_bytes=256, num_buffers=2, copies=copies)
    # on gloo every read is already on its device (the CPU): move each anyway, as to an accelerator
    place.finalizer = lambda dtype, device, to_device: (lambda raw: to_device(cast(raw, dtype)))
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    with sw.empty_model():
        model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    with tempfile.TemporaryDirectory() as tmp:
        st.save_file({k: v.contiguous() for k, v in full.state_dict().items()}, f"{tmp}/m.safetensors")
        sw.load(model, tmp, plan={"0": "colwise", "1": "rowwise"}, mesh=backend.mesh(tp=2))
    r, exact = backend.rank, []
    for name, t in full.state_dict().items():
        want = (t.chunk(2, 0)[r] if name.startswith("0.") else t.chunk(2, 1)[r] if name == "1.weight" else t)
        exact.append(torch.equal(local_of(model.get_parameter(name)), want))
    return all(exact) and len(exact) == 4, copies.copies


def test_a_load_joins_its_staged_copies_before_installing():
    from harness import run_ranks

    for exact, copied in run_ranks(_load_through_fake_staging, 2):
        assert exact and copied > 4  # every tensor staged, several pieces each
