"""Writing through obstore (``s3://``, ``gs://``): :class:`ObjectWriter` (one new object,
visible at its commit: one PUT, or a multipart upload streamed in the background and aborted on
any failure) and :class:`ObstorePublish`, the save transaction's five requests served by
obstore (the transaction itself is ``publish.Publish``)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from shardwise.errors import CheckpointError, UsageError
from shardwise.io.storage.publish import Publish
from shardwise.io.storage.remote import RemoteStorage


class ObstoreClient(RemoteStorage):
    """The base of the obstore client (``objects.ObjectStorage``, which imports this module):
    what writing asks of it beyond a remote storage's, its upload parts and a bucket's store."""

    upload_part: int

    def store(self, bucket: str) -> Any:
        raise NotImplementedError


class ObjectWriter:
    """A new object: buffered; one PUT at ``commit`` when it stays under a part (``part_size``, at
    least ``MIN_PART``), else a
    multipart upload streaming in the background from the first full part, completed at
    ``commit`` (the object appears whole then) and aborted on any failure or ``abort``."""

    _END, _ABORT = object(), object()

    def __init__(self, storage: ObstoreClient, bucket: str, key: str):
        self.storage, self.bucket, self.key = storage, bucket, key
        self.name = storage.url(bucket, key)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done = False

    def write(self, buf: memoryview) -> None:
        assert not self._done, "write after commit or abort"
        self._pending.append(bytes(buf))
        self._pending_bytes += len(buf)
        if self._pending_bytes >= self.storage.upload_part:
            self._flush()

    def pwrite(self, buf: memoryview, pos: int) -> None:
        raise UsageError(f"{self.name}: an object store cannot write at an offset (pwrite); objects are "
                         "written front to back")

    def _flush(self) -> None:
        if self._thread is None:
            self._queue = queue.Queue(maxsize=max(2, self.storage.concurrency // 2))
            self._thread = threading.Thread(target=self._upload, name="shardwise-upload", daemon=True)
            self._thread.start()
        assert self._queue is not None
        # the part's pieces as they are: obstore cuts its own parts from them (a join would copy)
        pieces, self._pending, self._pending_bytes = self._pending, [], 0
        self._put(pieces)

    def _put(self, item) -> None:
        assert self._queue is not None and self._thread is not None
        while self._thread.is_alive():  # an upload that failed takes nothing more
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue
        if item is not self._ABORT:
            self._raise()

    def _chunks(self) -> Iterator[bytes]:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            if item is self._END:
                return
            if item is self._ABORT:
                raise _Aborted("aborted")  # makes obstore abort the multipart upload
            yield from item

    def _upload(self) -> None:
        import obstore

        try:
            obstore.put(self.storage.store(self.bucket), self.key, self._chunks(), use_multipart=True,
                        chunk_size=self.storage.upload_part, max_concurrency=self.storage.concurrency)
        except BaseException as e:
            self._error = e

    def _raise(self) -> None:
        raise CheckpointError(f"uploading {self.name}: {self.storage.scrub(self._error)}") from None

    def commit(self) -> None:
        import obstore

        assert not self._done, "commit after commit or abort"
        self._done = True
        if self._thread is None:
            data = b"".join(self._pending)
            self._pending = []
            self.storage.call(lambda: obstore.put(self.storage.store(self.bucket), self.key, data,
                                                  use_multipart=False), f"PUT {self.name}")
            return
        if self._pending:
            self._put(self._pending)
            self._pending = []
        self._put(self._END)
        self._thread.join()
        if self._error is not None:
            self._raise()

    def abort(self) -> None:
        if self._done and self._thread is None:
            return
        self._done, self._pending = True, []
        if self._thread is not None and self._thread.is_alive():
            self._put(self._ABORT)
            self._thread.join()


class _Aborted(Exception):
    pass


class ObstorePublish(Publish):
    """``publish.Publish`` over obstore: its five requests, and a bucket made on a first write."""

    storage: ObstoreClient

    def _objects(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix/`` by its name below it (nested names keep their ``/``)."""
        import obstore

        store = self.storage.store(self.bucket)

        def listed():
            return [o for batch in obstore.list(store, prefix=f"{prefix}/") for o in batch]

        found = self.storage.call(listed, f"listing {self._url(prefix + '/')}")
        return {o["path"][len(prefix) + 1:]: int(o["size"]) for o in found}

    def _delete(self, keys: list[str]) -> None:
        """Delete the objects ``keys``; one already gone is no error."""
        import obstore
        from obstore.exceptions import NotFoundError

        store = self.storage.store(self.bucket)
        gone = (NotFoundError, FileNotFoundError)
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            try:
                self.storage.call(lambda b=batch: obstore.delete(store, b), f"deleting {len(batch)} "
                                  f"objects under {self._url(self.key)}", fatal=gone)
            except gone:  # one was gone already (what a delete asks for): the rest one by one
                for key in batch:
                    self.storage.call(lambda k=key: obstore.delete(store, k), f"deleting {self._url(key)}",
                                      absent=gone)

    def _put(self, key: str, data: bytes) -> None:
        import obstore

        store = self.storage.store(self.bucket)
        self.storage.call(lambda: obstore.put(store, key, data, use_multipart=False), f"PUT {self._url(key)}")

    def _copy(self, src: str, dst: str) -> None:
        import obstore

        store = self.storage.store(self.bucket)
        self.storage.call(lambda: obstore.copy(store, src, dst),
                          f"copying {self._url(src)} to {self._url(dst)}")

    def _folders(self, parent: str) -> list[str]:
        """The keys of the prefixes (folders) directly under ``parent`` ("" the bucket's root)."""
        import obstore

        store = self.storage.store(self.bucket)
        found = self.storage.call(lambda: obstore.list_with_delimiter(store, prefix=parent or None),
                                  f"listing {self._url(parent + '/')}")
        return [p.rstrip("/") for p in found["common_prefixes"]]

    def _make_bucket(self) -> bool:
        """Make the bucket where the store makes one on its first write (SeaweedFS, MinIO in some
        setups): put an empty marker object, then delete it. Where the store refuses (AWS S3,
        GCS), the ``NoSuchBucketError`` of the put says the command that makes it."""
        import obstore

        marker, store = ".shardwise-make-bucket", self.storage.store(self.bucket)
        self.storage.call(lambda: obstore.put(store, marker, b"", use_multipart=False),
                          f"PUT {self._url(marker)} (making the bucket)")
        self.storage.call(lambda: obstore.delete(store, marker), f"deleting {self._url(marker)}")
        return True


__all__ = ["ObjectWriter", "ObstorePublish"]
