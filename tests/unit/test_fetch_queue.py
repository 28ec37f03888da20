"""The exchange's request queue (io.read.fetch.Requests): a round's slab goes before the direct
reads still queued, and a slab is cut into requests that the threads fetch together."""

from __future__ import annotations

import threading

import torch

from shardwise.io.read.fetch import Requests
from shardwise.io.storage.remote import RemoteFile


def test_requests_marked_first_run_before_those_queued_earlier():
    """One thread, held busy: the direct reads queued first wait behind the slab queued later."""
    requests = Requests({}, num_threads=1)
    gate, ran = threading.Event(), []
    try:
        hold = requests.submit([gate.wait])
        direct = requests.submit([lambda k=k: ran.append(("direct", k)) for k in range(3)])
        slab = requests.submit([lambda k=k: ran.append(("slab", k)) for k in range(2)], first=True)
        gate.set()
        for future in hold + direct + slab:
            future.result(timeout=30)
    finally:
        requests.close()
    assert ran == [("slab", 0), ("slab", 1), ("direct", 0), ("direct", 1), ("direct", 2)]


def test_a_failed_request_hands_its_error_to_its_future_and_close_cancels_the_rest():
    requests = Requests({}, num_threads=1)
    gate = threading.Event()

    def fails():
        raise OSError("the store went away")

    held = requests.submit([gate.wait])
    failed = requests.submit([fails])
    left = requests.submit([lambda: None] * 3)
    try:
        gate.set()
        assert isinstance(failed[0].exception(timeout=30), OSError)
        held[0].result(timeout=30)
    finally:
        requests.close()
    assert all(f.done() for f in left)  # run or cancelled: none left pending for a waiter


class _Client:
    part_size = 8 << 20
    pool = None

    def url(self, bucket: str, key: str) -> str:
        return f"s3://{bucket}/{key}"

    def get_range(self, file, start, end, land) -> None:
        land(0, memoryview(bytes(range(256)) * ((end - start) // 256 + 1))[:end - start])


def test_a_smaller_part_size_spreads_runs_over_more_requests():
    """The storage's 8 MiB parts make one request of a 1 MiB run; ``part_size`` 256 KiB four,
    which land the same bytes."""
    handle = RemoteFile(_Client(), "b", "k", 4 << 20, None)
    out = []
    for part in (None, 256 << 10):
        buf = torch.zeros(1 << 20, dtype=torch.uint8)
        landed: list[int] = []
        calls = handle.run_requests([(0, memoryview(buf.numpy()))],
                                    lambda i, n, landed=landed: landed.append(n), part)
        for call in calls:
            call()
        assert sum(landed) == 1 << 20
        out.append((len(calls), bytes(buf[:512].numpy())))
    assert [n for n, _ in out] == [1, 4]
    assert out[0][1] == out[1][1] == bytes(range(256)) * 2
