"""The save transaction on an object store: complete or absent, and the previous checkpoint at
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
import re
import secrets
from pathlib import Path

from shardwise.errors import CheckpointError
from shardwise.io.storage.objects import ObjectStorage, split_location
from shardwise.io.storage.transaction import TMP_MARK, _owner

PUBLISH_MARK = ".shardwise-publish.json"
# The files a checkpoint prefix may hold for overwrite=True to replace it (as the local
# transaction's rule): nothing else is deleted.
_CHECKPOINT_FILE = re.compile(r".*\.safetensors|.*\.safetensors\.index\.json|\.metadata|.*\.distcp"
                              r"|shardwise\.json|config\.json|generation_config\.json")


def _beside(key: str, mark: str) -> str:
    parent, _, name = key.rpartition("/")
    return f"{parent}/.{name}{mark}" if parent else f".{name}{mark}"


def publishing(storage: ObjectStorage, bucket: str, key: str) -> dict | None:
    """The journal of a publish to the prefix ``key`` under way or interrupted, else None."""
    import obstore

    if not key or storage.head(bucket, _beside(key, PUBLISH_MARK)) is None:
        return None
    raw = storage.call(lambda: bytes(obstore.get(storage.store(bucket), _beside(key, PUBLISH_MARK)).bytes()),
                       f"GET {storage.url(bucket, _beside(key, PUBLISH_MARK))}")
    try:
        journal = json.loads(raw)
        assert isinstance(journal["staging"], str) and isinstance(journal["files"], list)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise CheckpointError(f"{storage.url(bucket, _beside(key, PUBLISH_MARK))}: not a publish journal "
                              f"({e}); delete it if no save is running") from None
    return journal


def redirect(storage: ObjectStorage, bucket: str, key: str) -> tuple[str, str]:
    """Where ``bucket/key`` is read: in the staging prefix while its folder is being published."""
    folder, _, name = key.rpartition("/")
    journal = publishing(storage, bucket, folder) if folder else None
    if journal is None or name not in journal["files"]:
        return bucket, key
    return bucket, f"{journal['staging']}/{name}"


class Publish:
    """The object-store :class:`~shardwise.io.storage.Transaction` (see the module doc)."""

    def __init__(self, storage: ObjectStorage, target, overwrite: bool):
        self.storage, self.overwrite = storage, overwrite
        self.bucket, self.key = split_location(target)
        if not self.key:
            raise CheckpointError(f"{storage.url(self.bucket, '')}: name a prefix to save to, not the bucket")
        self.target = Path(self.bucket, self.key)
        self.folder: Path | None = None
        self._staging: str | None = None

    def _url(self, key: str) -> str:
        return self.storage.url(self.bucket, key)

    def _objects(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix/`` by its name below it (nested names keep their ``/``)."""
        import obstore

        store = self.storage.store(self.bucket)

        def listed():
            return [o for batch in obstore.list(store, prefix=f"{prefix}/") for o in batch]

        found = self.storage.call(listed, f"listing {self._url(prefix + '/')}")
        return {o["path"][len(prefix) + 1:]: int(o["size"]) for o in found}

    def _delete(self, keys: list[str]) -> None:
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

    def prepare(self) -> None:
        journal = publishing(self.storage, self.bucket, self.key)
        if journal is not None:  # an interrupted publish: its checkpoint is whole, finish it
            self._publish(journal)
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
        self._staging = _beside(self.key, f"{TMP_MARK}{_owner()}-{secrets.token_hex(4)}")
        self.folder = Path(self.bucket, self._staging)

    def _remove_stale(self) -> None:
        import obstore

        parent, _, name = self.key.rpartition("/")
        head = f"{parent}/.{name}{TMP_MARK}" if parent else f".{name}{TMP_MARK}"
        store = self.storage.store(self.bucket)
        stale = self.storage.call(lambda: [o["path"] for b in obstore.list(store, prefix=head) for o in b],
                                  f"listing {self._url(head)}")
        self._delete(stale)

    def commit(self, index: tuple[str, dict] | None) -> None:
        """Write the index if any, last; then publish the staged checkpoint (the module doc)."""
        import obstore

        assert self._staging is not None, "commit before prepare"
        store = self.storage.store(self.bucket)
        if index is not None:
            text = json.dumps(index[1], indent=2, sort_keys=True) + "\n"
            key = f"{self._staging}/{index[0]}"
            self.storage.call(lambda: obstore.put(store, key, text.encode(), use_multipart=False),
                              f"PUT {self._url(key)}")
        files = sorted(self._objects(self._staging))
        last = [index[0]] if index is not None and index[0] in files else []
        journal = {"staging": self._staging, "files": [f for f in files if f not in last] + last,
                   "host_pid": _owner()}
        journal_key = _beside(self.key, PUBLISH_MARK)
        self.storage.call(lambda: obstore.put(store, journal_key, json.dumps(journal).encode(),
                                              use_multipart=False), f"PUT {self._url(journal_key)}")
        self._staging, self.folder = None, None  # from here on the journal owns the staging prefix
        self._publish(journal)

    def _publish(self, journal: dict) -> None:
        """Step 3 of the module doc; safe to run again after an interruption (each step is)."""
        import obstore

        store = self.storage.store(self.bucket)
        staging, files = journal["staging"], journal["files"]
        for name in files:  # the index last: a reader that skips the journal finds it only now
            src, dst = f"{staging}/{name}", f"{self.key}/{name}"
            if self.storage.head(self.bucket, src) is None:
                continue  # copied and cleaned by an earlier, interrupted publish
            self.storage.call(lambda s=src, d=dst: obstore.copy(store, s, d), f"copying {self._url(src)} to "
                              f"{self._url(dst)}")
        old = [f"{self.key}/{n}" for n in self._objects(self.key) if n not in files]
        self._delete(old)
        self._delete([_beside(self.key, PUBLISH_MARK)])
        self._delete([f"{staging}/{n}" for n in self._objects(staging)])

    def discard(self) -> None:
        if self._staging is not None:
            staging, self._staging, self.folder = self._staging, None, None
            self._delete([f"{staging}/{n}" for n in self._objects(staging)])


__all__ = ["PUBLISH_MARK", "Publish", "publishing", "redirect"]
