"""What a read of an object store asks before its data: where an object is read (the publish
journal's redirect) and what is there (listings, sizes, ETags), shared by ``objects`` and
``fsspec``; and :func:`one_look`, the scope in which a load asks each of them once.

A store answers each question with a round trip. Unscoped, every ``open`` / ``stat`` / ``list``
asks again: a load of a 4-file checkpoint made ~13 listings and ~40 HEADs (the journal beside
the checkpoint once per object). Inside ``one_look()`` a storage keeps each answer (a HEAD, a
listing with its objects' sizes and ETags, a journal) until the scope ends, so a load asks each
once. That is safe because the data GETs still check the ETag each object had when it was
looked up: an object replaced after the look fails its read, never mixes; a publish under way
when the load looks is followed for the whole load. The memo is this thread's (a contextvar);
pool threads ask the store themselves.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from fnmatch import fnmatchcase

from shardwise.errors import CheckpointError, UsageError

TMP_MARK, OLD_MARK = ".shardwise-tmp-", ".shardwise-old-"  # a save's staging folder, a replaced one
PUBLISH_MARK = ".shardwise-publish.json"  # the journal of a publish (publish.Publish)
DONE_MARK = ".shardwise-published.json"  # the tokens of the last saves committed there

_MEMO: ContextVar[dict | None] = ContextVar("shardwise_storage_memo", default=None)


def host() -> str:
    """This host's name as a file name's part (a staging folder names its owner)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64]


def owner() -> str:
    """``{host}-{pid}``: the owner a save's staging folder and journal name."""
    return f"{host()}-{os.getpid()}"


def foreign(names: Iterable[str], replaceable: Sequence[str]) -> list[str]:
    """The ``names`` that match none of the ``replaceable`` patterns (``fnmatch``): what a save
    told it may replace those (a transaction's ``replaceable``) must leave alone."""
    return [n for n in names if not any(fnmatchcase(n, p) for p in replaceable)]


def split_location(location) -> tuple[str, str]:
    """``("bucket", "a/b")`` for ``bucket/a/b``, ``s3://bucket/a/b`` or ``Path("s3:/bucket/a/b")``."""
    path = getattr(location, "path", None)  # a Location: its key; else a str or path
    text = (path.as_posix() if path is not None else os.fspath(location)).replace("\\", "/")
    scheme, sep, rest = text.partition(":/")
    if sep and scheme.isidentifier():
        text = rest
    bucket, _, key = text.strip("/").partition("/")
    if not bucket:
        raise UsageError(f"{os.fspath(location)!r}: an object-store location is bucket/prefix")
    return bucket, key.strip("/")


@contextmanager
def one_look() -> Iterator[None]:
    """Within the block, each storage question of this thread is asked of the store once
    (nested blocks share the outer one's answers). Every rank's load runs in one.

    >>> with one_look():                                  # doctest: +SKIP
    ...     source = open_source(locate("s3://bucket/ckpt"))
    """
    if _MEMO.get() is not None:
        yield
        return
    token = _MEMO.set({})
    try:
        yield
    finally:
        _MEMO.reset(token)


def remembered(key: tuple, ask: Callable):
    """``ask()``, or inside :func:`one_look` its answer for ``key`` from the first time."""
    memo = _MEMO.get()
    if memo is None:
        return ask()
    if key not in memo:
        memo[key] = ask()
    return memo[key]


def listed(key: tuple):
    """What :func:`remembered` holds for ``key`` inside :func:`one_look`, else None."""
    memo = _MEMO.get()
    return None if memo is None else memo.get(key)


def beside(key: str, mark: str) -> str:
    parent, _, name = key.rpartition("/")
    return f"{parent}/.{name}{mark}" if parent else f".{name}{mark}"


def publishing(storage, bucket: str, key: str) -> dict | None:
    """The journal of a save to ``key`` under way or interrupted, else None (any storage's):
    a publish of a staged checkpoint, or ``{"direct": True}``, a save into the empty prefix.
    A journal whose ``token`` the record beside ``key`` lists is stale (:func:`committed`)."""
    if not key:
        return None
    return remembered((storage, "journal", bucket, key), lambda: _journal(storage, bucket, key))


def committed(storage, bucket: str, key: str) -> list[str]:
    """The tokens of the last saves committed at ``key`` (the record beside it; [] if none).

    Why the record: a commit ends by deleting the journal, and a journal PUT that timed out
    at the client and was retried may still reach the store after that delete (a late
    duplicate: seen on SeaweedFS under load). A journal back from the dead would hide a whole
    checkpoint, and the next save would clear it as an interrupted one. Each journal carries a
    token; the commit adds it here before it deletes the journal, so a token listed here
    names a save that is over."""
    if storage.head(bucket, beside(key, DONE_MARK)) is None:
        return []
    try:
        tokens = json.loads(storage.get_bytes(bucket, beside(key, DONE_MARK)))["tokens"]
        assert isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise CheckpointError(f"{storage.url(bucket, beside(key, DONE_MARK))}: not a record of committed "
                              f"saves ({e}); delete it if no save is running") from None
    return tokens


def _journal(storage, bucket: str, key: str) -> dict | None:
    if storage.head(bucket, beside(key, PUBLISH_MARK)) is None:
        return None
    raw = storage.get_bytes(bucket, beside(key, PUBLISH_MARK))
    try:
        journal = json.loads(raw)
        assert journal.get("direct") is True or (isinstance(journal["staging"], str)
                                                 and isinstance(journal["files"], list))
    except (ValueError, KeyError, TypeError, AssertionError, AttributeError) as e:
        raise CheckpointError(f"{storage.url(bucket, beside(key, PUBLISH_MARK))}: not a publish journal "
                              f"({e}); delete it if no save is running") from None
    if journal.get("token") is not None and journal["token"] in committed(storage, bucket, key):
        return None  # a late duplicate of a committed save's journal (committed's doc)
    return journal


def redirect(storage, bucket: str, key: str) -> tuple[str, str]:
    """Where ``bucket/key`` is read: in the staging prefix while its folder is being published."""
    folder, _, name = key.rpartition("/")
    journal = publishing(storage, bucket, folder) if folder else None
    if journal is not None and journal.get("direct"):  # empty until commit: a key never written
        return bucket, f"{beside(folder, PUBLISH_MARK)}/{name}"
    if journal is None or name not in journal["files"]:
        return bucket, key
    return bucket, f"{journal['staging']}/{name}"


__all__ = ["DONE_MARK", "PUBLISH_MARK", "beside", "committed", "foreign", "listed", "one_look", "publishing",
           "redirect", "remembered"]
