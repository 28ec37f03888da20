"""The save transaction of every remote store (:class:`Publish`), complete or absent, and the
previous checkpoint at the prefix readable until the new one is whole, although a store can
rename nothing atomically. The steps and the journal are here; each client (``objects`` over
obstore, ``fsspec``) serves the five requests they make, and imports this module.

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
import secrets
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

from shardwise.errors import CheckpointError
from shardwise.io.storage.faults import NoSuchBucketError
from shardwise.io.storage.lookups import (
    DONE_MARK,
    PUBLISH_MARK,
    TMP_MARK,
    beside,
    committed,
    foreign,
    owner,
    publishing,
)


class Publish:
    """The remote :class:`~shardwise.io.storage.Transaction` (see the module doc) of ``storage``
    (a ``remote.RemoteStorage``) at ``target`` (a Location, or a str / path in the storage's own
    tests): its ``key`` in its ``bucket`` ("" where the store has none). The steps call five
    primitives of the store (``_objects``, ``_delete``, ``_put``, ``_copy``, ``_folders``),
    which each client's subclass serves: ``objects_write.ObstorePublish``, ``fsspec.FsspecPublish``."""

    _direct = False  # set by prepare when the prefix is empty: no staging prefix, no copies

    def __init__(self, storage, target, overwrite: bool, replaceable: tuple[str, ...] = ()):
        self.storage, self.overwrite, self.replaceable = storage, overwrite, replaceable
        self.bucket, self.key = storage.split(target)
        if not self.key.strip("/"):
            raise CheckpointError(f"{storage.url(self.bucket, self.key)}: name a prefix to save to, not the "
                                  "root")
        self.target: Any = target
        self.folder: Any = None
        self._staging: str | None = None

    def _url(self, key: str) -> str:
        return self.storage.url(self.bucket, key)

    # --- the store's primitives: each client's subclass serves them -----------------------

    def _objects(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix/`` by its name below it (nested names keep their ``/``)."""
        raise NotImplementedError

    def _delete(self, keys: list[str]) -> None:
        """Delete the objects ``keys``; one already gone is no error."""
        raise NotImplementedError

    def _put(self, key: str, data: bytes) -> None:
        """Write the small object ``key`` whole."""
        raise NotImplementedError

    def _copy(self, src: str, dst: str) -> None:
        """Copy the object ``src`` to ``dst`` (server-side where the store can)."""
        raise NotImplementedError

    def _folders(self, parent: str) -> list[str]:
        """The keys of the prefixes (folders) directly under ``parent`` ("" the bucket's root)."""
        raise NotImplementedError

    def _make_bucket(self) -> bool:
        """Make the missing bucket where a first write may (True), else False (the default)."""
        return False

    # --- the transaction ------------------------------------------------------------------

    def prepare(self) -> None:
        try:
            self._prepare()
        except NoSuchBucketError:  # a new bucket: made where the store makes one on a write
            if not self._make_bucket():
                raise
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
        others = foreign(existing, self.replaceable)  # as the local rule: only what the save's formats write
        if others:
            raise CheckpointError(
                f"overwrite=True replaces the whole prefix {self._url(self.key)}, but it also holds "
                f"{others[0]!r}, which is not a checkpoint file; move that out first, or save elsewhere")
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
        self._clear(self.storage.split(folder)[1])

    def discard(self) -> None:
        if self._staging is not None:
            staging, self._staging, self.folder = self._staging, None, None
            self._clear(staging)
            if self._direct:  # the prefix was empty: what is there is this save's, now gone
                self._delete([beside(self.key, PUBLISH_MARK)])


__all__ = ["PUBLISH_MARK", "Publish"]
