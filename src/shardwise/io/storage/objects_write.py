"""Writing to an object store: :class:`ObjectWriter` (one new object, visible at its commit)
and the save transaction, complete or absent, and the previous checkpoint at
the prefix readable until the new one is whole, although a store can rename nothing atomically.

Call order (rank 0; see ``shardwise.io.storage``): ``prepare()`` finishes or clears what an
earlier interrupted save to the same prefix left, checks the target and picks a staging
prefix beside it, ``.{name}.shardwise-tmp-{host}-{pid}-{token}/``, where every rank's writers
put the files (each object appears whole when its writer commits). ``commit(index)`` then:

1. writes the index (``model.safetensors.index.json``, ``.metadata``) into the staging prefix,
   last; the staged checkpoint is now whole;
2. writes the journal ``.{name}.shardwise-publish.json`` beside the target, naming the staging
   prefix and the new files. From this instant every read of the target through shardwise
   (``open`` / ``stat`` / ``list`` of ``prefix/*``) is served from the staging prefix: the new
   checkpoint, whole. Before it, the old one is read, untouched;
3. copies the staged objects over the target (server-side copies; the index last), deletes
   the old checkpoint's files that the new one does not have, deletes the journal, then the
   staging prefix.

A save to an empty prefix skips the staging and the copies: the journal ``{"direct": true}`` is
written first (the prefix reads as empty while it stands), the files straight to their keys,
the index last, then the journal is deleted; a killed one is cleared by the next ``prepare``.
Every journal carries the save's ``token``; a commit adds it to the record
``.{name}.shardwise-published.json`` beside the target before it deletes the journal, so a
late duplicate of the journal's PUT (retried after a client timeout, landing after the delete)
is taken as stale, by loads and by the next ``prepare``, which deletes it (``lookups.committed``).
A save killed before step 2 leaves a staging prefix that no load reads and the next
``prepare`` to that prefix deletes. A save killed during step 3 leaves the journal: loads
keep reading the new checkpoint from the staging prefix, and the next ``prepare`` to that
prefix finishes the copies first (rolls forward). A load that overlaps a publish fails with a
``CheckpointError`` (an object replaced under a reader fails its ETag check), never mixes the
two. Tools other than shardwise that read the prefix during step 3 see a mix: they should
read only after the save returns. One save per prefix at a time: another host's staging
prefix is taken as stale.
"""

from __future__ import annotations

import json
import queue
import re
import secrets
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from shardwise.errors import CheckpointError, UsageError
from shardwise.io.storage.faults import NoSuchBucketError, make_bucket
from shardwise.io.storage.lookups import (
    DONE_MARK,
    PUBLISH_MARK,
    TMP_MARK,
    beside,
    committed,
    owner,
    publishing,
    split_location,
)

if TYPE_CHECKING:
    from shardwise.io.storage.objects import ObjectStorage

# The files a checkpoint prefix may hold for overwrite=True to replace it (as the local
# transaction's rule): nothing else is deleted.
_CHECKPOINT_FILE = re.compile(r".*\.safetensors|.*\.safetensors\.index\.json|\.metadata|.*\.distcp"
                              r"|shardwise\.json|config\.json|generation_config\.json")


class ObjectWriter:
    """A new object: buffered; one PUT at ``commit`` when it stays under a part (``part_size``, at
    least ``MIN_PART``), else a
    multipart upload streaming in the background from the first full part, completed at
    ``commit`` (the object appears whole then) and aborted on any failure or ``abort``."""

    _END, _ABORT = object(), object()

    def __init__(self, storage: ObjectStorage, bucket: str, key: str):
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



class Publish:
    """The object-store :class:`~shardwise.io.storage.Transaction` (see the module doc). The
    steps call five primitives of the store (``_objects``, ``_delete``, ``_put``, ``_copy``,
    ``_folders``): obstore's here; ``fsspec.FsspecPublish`` serves them over an fsspec filesystem."""

    _direct = False  # set by prepare when the prefix is empty: no staging prefix, no copies

    def __init__(self, storage: ObjectStorage, target, overwrite: bool):
        self.storage, self.overwrite = storage, overwrite
        self.bucket, self.key = split_location(target)
        if not self.key:
            raise CheckpointError(f"{storage.url(self.bucket, '')}: name a prefix to save to, not the bucket")
        # a Location (the pipelines'), or a str / path (the storage's own tests)
        self.target: Any = target if hasattr(target, "storage") else Path(self.bucket, self.key)
        self.folder: Any = None
        self._staging: str | None = None

    def _url(self, key: str) -> str:
        return self.storage.url(self.bucket, key)

    # --- the store's primitives (obstore here; a subclass serves another store) ------------

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
                    try:
                        self.storage.call(lambda k=key: obstore.delete(store, k), f"deleting "
                                          f"{self._url(key)}", fatal=gone)
                    except gone:
                        pass

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

    # --- the transaction ------------------------------------------------------------------

    def prepare(self) -> None:
        try:
            self._prepare()
        except NoSuchBucketError:  # a new bucket: made where the store makes one on a write
            if not getattr(self.storage, "makes_buckets", False):  # fsspec's stores make none
                raise
            make_bucket(self.storage, self.bucket)
            self._prepare()

    def _prepare(self) -> None:
        self._token = secrets.token_hex(8)  # names this save in its journal and at commit
        journal = publishing(self.storage, self.bucket, self.key)
        if journal is not None and journal.get("direct"):  # an interrupted save into an empty prefix
            self._clear(self.key)
            self._delete([beside(self.key, PUBLISH_MARK)])
        elif journal is not None:  # an interrupted publish: its checkpoint is whole, finish it
            self._publish(journal)
        elif self.storage.head(self.bucket, beside(self.key, PUBLISH_MARK)) is not None:
            self._delete([beside(self.key, PUBLISH_MARK)])  # a committed save's, back late: stale
        self._remove_stale()
        existing = self._objects(self.key)
        if existing and not self.overwrite:
            raise CheckpointError(f"{self._url(self.key)} already holds {len(existing)} objects; pass "
                                  "overwrite=True to replace them once the new checkpoint is complete, or "
                                  "choose another prefix")
        foreign = [n for n in existing if not _CHECKPOINT_FILE.fullmatch(n)]
        if foreign:
            raise CheckpointError(
                f"overwrite=True replaces the whole prefix {self._url(self.key)}, but it also holds "
                f"{foreign[0]!r}, which is not a checkpoint file; move that out first, or save elsewhere")
        if not existing:
            # Nothing to keep readable: the files go straight to their keys, with no copy (a
            # copy doubles the writes, and S3 copies at most 5 GiB in one request, which
            # obstore cannot split). The journal, written first, makes shardwise refuse to read
            # the prefix until commit; the index, written last, is what other tools look for.
            self._direct = True
            journal = {"direct": True, "host_pid": owner(), "token": self._token}
            self._put(beside(self.key, PUBLISH_MARK), json.dumps(journal).encode())
            self._staging = self.key
        else:
            self._staging = beside(self.key, f"{TMP_MARK}{owner()}-{secrets.token_hex(4)}")
        staging = PurePosixPath(self.bucket, self._staging)
        located = hasattr(self.target, "storage")
        self.folder = replace(self.target, path=staging) if located else Path(staging)

    def _clear(self, prefix: str) -> None:
        """Delete every object under ``prefix/``, listing again until none is left (SeaweedFS
        was seen to keep one object of a batch delete; bounded: three rounds)."""
        for _ in range(3):
            keys = [f"{prefix}/{n}" for n in self._objects(prefix)]
            if not keys:
                return
            self._delete(keys)

    def _remove_stale(self) -> None:
        """Delete the staging prefixes of earlier saves to the target (picked by name among
        the parent's prefixes)."""
        parent, _, name = self.key.rpartition("/")
        head = f".{name}{TMP_MARK}"
        for prefix in self._folders(parent):
            if prefix.rpartition("/")[2].startswith(head):
                self._clear(prefix)

    def commit(self, index: tuple[str, dict] | None) -> None:
        """Write the index if any, last; then publish the staged checkpoint (the module doc)."""
        assert self._staging is not None, "commit before prepare"
        if index is not None:
            text = json.dumps(index[1], indent=2, sort_keys=True) + "\n"
            self._put(f"{self._staging}/{index[0]}", text.encode())
        if self._direct:  # every file is in place: the checkpoint is whole once the journal goes
            self._staging, self.folder = None, None
            self._done(self._token)
            self._delete([beside(self.key, PUBLISH_MARK)])
            return
        files = sorted(self._objects(self._staging))
        last = [index[0]] if index is not None and index[0] in files else []
        journal = {"staging": self._staging, "files": [f for f in files if f not in last] + last,
                   "host_pid": owner(), "token": self._token}
        self._put(beside(self.key, PUBLISH_MARK), json.dumps(journal).encode())
        self._staging, self.folder = None, None  # from here on the journal owns the staging prefix
        self._publish(journal)

    def _publish(self, journal: dict) -> None:
        """Step 3 of the module doc; safe to run again after an interruption (each step is)."""
        staging, files = journal["staging"], journal["files"]
        for name in files:  # the index last: a reader that skips the journal finds it only now
            src = f"{staging}/{name}"
            if self.storage.head(self.bucket, src) is None:
                continue  # copied and cleaned by an earlier, interrupted publish
            self._copy(src, f"{self.key}/{name}")
        old = [f"{self.key}/{n}" for n in self._objects(self.key) if n not in files]
        self._delete(old)
        if journal.get("token") is not None:  # older journals have none
            self._done(journal["token"])
        self._delete([beside(self.key, PUBLISH_MARK)])
        self._clear(staging)

    def _done(self, token: str) -> None:
        """Record ``token`` as committed at the target, before its journal is deleted: a late
        duplicate of the journal is then known stale (``lookups.committed``); the last 16 kept.
        A store whose requests run in this process (fsspec's memory, file) needs no record."""
        if not self.storage.late_writes:
            return
        tokens = [t for t in committed(self.storage, self.bucket, self.key) if t != token]
        self._put(beside(self.key, DONE_MARK), json.dumps({"tokens": [*tokens, token][-16:]}).encode())

    def sweep(self, folder) -> None:
        """Best effort after a failed save, on a rank that does not hold the transaction (its
        holder may be dead or partitioned, and a rank's last objects may land after the holder's
        ``discard``): delete what is under ``folder``, the save's staging prefix or, for a save
        into an empty prefix, the target itself. Call it only where no rank can commit any more
        (``sink.Saving``: before the save's commit begins); the journal of a save into an empty
        prefix stays (the prefix reads as empty) until the next save there removes it."""
        self._clear(split_location(folder)[1])

    def discard(self) -> None:
        if self._staging is not None:
            staging, self._staging, self.folder = self._staging, None, None
            self._clear(staging)
            if self._direct:  # the prefix was empty: what is there is this save's, now gone
                self._delete([beside(self.key, PUBLISH_MARK)])


__all__ = ["ObjectWriter", "Publish"]
