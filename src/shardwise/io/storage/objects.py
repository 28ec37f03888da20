"""Object stores as a :class:`~shardwise.io.storage.Storage`: ``s3://bucket/prefix`` and
``gs://bucket/prefix`` through obstore (docs/guide.md says why), configured by the ``AWS_*`` /
``GOOGLE_*`` variables, ``STORAGE_EMULATOR_HOST`` or ``storage_options=`` (obstore's keys, plus
``part_size``, ``concurrency``, ``retries``, ``timeout``).

Reads: every GET is ranged, checked against the length and ETag of ``open``'s HEAD (an object
replaced under a reader is an error, never a mix), retried with bounded backoff on throttling,
resets, timeouts and short bodies; runs are coalesced into requests of at most ``part_size``
that read at most 1/20 more than asked, ``concurrency`` in flight; no mapped views. Writes
(``objects_write``): visible only at ``commit``, multipart uploads aborted on failure, no
positional writes; a save is ``publish.Publish`` over obstore's requests. The retries, the
coalescing and the ranged reads are ``remote``'s, shared with ``fsspec``. No error shows a secret.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardwise.errors import CheckpointError, UsageError
from shardwise.io.storage.lookups import listed, remembered, split_location
from shardwise.io.storage.objects_write import ObjectWriter, ObstoreClient, ObstorePublish
from shardwise.io.storage.remote import CHUNK, RemoteFile, ShortBody, cached

MIN_PART = 5 << 20      # S3's smallest part of a multipart upload (but the last)


class ObjectStorage(ObstoreClient):
    """The storage of one scheme (``"s3"`` or ``"gs"``) with one configuration; a client per
    bucket, made on first use. Every method may be called from any thread."""

    secret_variables = ("AWS_", "GOOGLE_")
    fetch_once = True  # a request costs a round trip: a job's load reads each byte once (io.exchange)
    late_writes = True  # a request may reach the store after its client gave up (lookups.committed)

    def __init__(self, scheme: str, **options):
        if scheme not in ("s3", "gs"):
            raise UsageError(f"object storage serves 's3' and 'gs', not {scheme!r}")
        super().__init__(scheme, options)
        self.upload_part = max(MIN_PART, self.part_size)
        self.timeout = float(options.pop("timeout", 60.0))
        self._options = options
        self._stores: dict[str, object] = {}
        self._lock = threading.Lock()

    def url(self, bucket: str, key: str) -> str:
        return f"{self.scheme}://{bucket}/{key.lstrip('/')}"

    # --- the client ------------------------------------------------------------------------

    def store(self, bucket: str):
        with self._lock:
            if bucket not in self._stores:
                self._stores[bucket] = self._make_store(bucket)
            return self._stores[bucket]

    def _make_store(self, bucket: str):
        try:
            from obstore.store import GCSStore, S3Store
        except ImportError as e:
            raise UsageError(f"{self.scheme}:// locations need obstore: "
                             "pip install 'shardwise[remote]'") from e
        from datetime import timedelta

        # obstore's TypedDicts, built from the user's mapping: checked by obstore, not by mypy
        config: Any = dict(self._options)
        client: Any = {k: config.pop(k) for k in list(config) if k in _CLIENT_KEYS}
        client.setdefault("timeout", timedelta(seconds=self.timeout))
        client.setdefault("connect_timeout", timedelta(seconds=min(10.0, self.timeout)))
        retry: Any = {"max_retries": 4, "retry_timeout": timedelta(seconds=4 * self.timeout),
                      "backoff": {"init_backoff": timedelta(milliseconds=50),
                                  "max_backoff": timedelta(seconds=2)}}
        allow_http = os.environ.get("AWS_ALLOW_HTTP" if self.scheme == "s3" else "GOOGLE_ALLOW_HTTP")
        if allow_http is not None:  # a client option, which obstore reads from no variable
            client.setdefault("allow_http", allow_http.strip().lower() in ("1", "true", "yes"))
        try:
            if self.scheme == "s3":
                return S3Store(bucket, config=config, client_options=client, retry_config=retry)
            emulator = os.environ.get("STORAGE_EMULATOR_HOST")
            if emulator and not any(k in config for k in ("service_account", "service_account_key",
                                                          "application_credentials")):
                if "://" not in emulator:
                    emulator = f"http://{emulator}"
                config["service_account_key"] = json.dumps({
                    "gcs_base_url": emulator.rstrip("/"), "disable_oauth": True, "client_email": "",
                    "private_key": "", "private_key_id": ""})
                client.setdefault("allow_http", emulator.startswith("http://"))
            return GCSStore(bucket, config=config, client_options=client, retry_config=retry)
        except Exception as e:  # a bad option, missing credentials
            raise UsageError(f"{self.url(bucket, '')}: cannot configure the client: "
                             f"{self.scrub(e)}") from None

    # --- the Storage protocol (open, stat, list, is_folder, check_inside: RemoteStorage's) -------

    def names(self, bucket: str, key: str) -> dict[str, dict | None]:
        prefix = f"{key}/" if key else ""
        return remembered((self, "list", bucket, prefix), lambda: self._list(bucket, prefix))

    def _list(self, bucket: str, prefix: str) -> dict[str, dict | None]:
        """``{name: its HEAD's metadata (an object) or None (a folder)}`` directly under ``prefix``."""
        import obstore

        found = self.call(lambda: obstore.list_with_delimiter(self.store(bucket), prefix=prefix or None),
                          f"listing {self.url(bucket, prefix)}")
        names: dict[str, dict | None] = {o["path"][len(prefix):]: o for o in found["objects"]}
        for folder in found["common_prefixes"]:
            names.setdefault(folder[len(prefix):].rstrip("/"), None)
        return {n: meta for n, meta in names.items() if n}

    def create(self, location: Path, *, existing: bool = False):
        bucket, key = split_location(location)
        self.refuse_existing(self.url(bucket, key), existing)
        return ObjectWriter(self, bucket, key)

    def transaction(self, target: Path, *, overwrite: bool, replaceable: Sequence[str] = ()):
        return ObstorePublish(self, target, overwrite, tuple(replaceable))

    # --- requests, retried -------------------------------------------------------------------

    def get_range(self, file: RemoteFile, start: int, end: int, land) -> None:
        """``RemoteStorage.get_range``: one streamed GET, no whole body held (16 in flight x 8 MiB
        would be 128 MiB), checked against the ETag the file was opened at."""
        import obstore

        name, etag = file.name, file.etag

        def request():
            result = obstore.get(self.store(file.bucket), file.key, options={"range": (start, end)})
            now = result.meta.get("e_tag")
            if etag and now and now.strip('"') != etag.strip('"'):
                raise CheckpointError(f"{name}: the object was replaced while being read (ETag "
                                      f"{etag} when opened, {now} now); load it again")
            got = 0
            for chunk in result.stream(min_chunk_size=CHUNK):
                land(got, memoryview(chunk))
                got += len(chunk)
            if got != end - start:
                raise ShortBody(f"{got} bytes in the body of a {end - start}-byte range")

        self.call(request, f"GET {name} bytes [{start}, {end})")

    def get_bytes(self, bucket: str, key: str) -> bytes:
        import obstore

        return self.call(lambda: bytes(obstore.get(self.store(bucket), key).bytes()),
                         f"GET {self.url(bucket, key)}")

    def head(self, bucket: str, key: str) -> dict | None:
        """The object's metadata (size, ETag), None when absent; inside ``lookups.one_look``
        answered by a listing of its prefix made in the same scope, when there is one."""
        if not key:
            return None
        parent, _, name = key.rpartition("/")
        listing = listed((self, "list", bucket, f"{parent}/" if parent else ""))
        if listing is not None and name not in listing:
            return None
        if listing is not None and (listing[name] or {}).get("e_tag"):  # the ETag check needs one
            return listing[name]
        return remembered((self, "head", bucket, key), lambda: self._head(bucket, key))

    def _head(self, bucket: str, key: str) -> dict | None:
        import obstore
        from obstore.exceptions import NotFoundError

        return self.call(lambda: obstore.head(self.store(bucket), key), f"HEAD {self.url(bucket, key)}",
                         absent=(NotFoundError, FileNotFoundError))

    def is_final(self, error: Exception) -> bool:
        """Absent, denied, misconfigured, a 4xx answer."""
        from obstore.exceptions import (
            InvalidPathError,
            NotFoundError,
            PermissionDeniedError,
            UnauthenticatedError,
            UnknownConfigurationKeyError,
        )

        final = (InvalidPathError, NotFoundError, FileNotFoundError, PermissionDeniedError,
                 UnauthenticatedError, UnknownConfigurationKeyError)
        return isinstance(error, final) or bool(_FINAL_STATUS.search(str(error)))


_FINAL_STATUS = re.compile(r"status code: (400|401|403|404|405|411|412|416)\b|builder error")
_CLIENT_KEYS = {"allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type",
                "default_headers", "pool_idle_timeout", "pool_max_idle_per_host", "proxy_url", "timeout",
                "user_agent", "http1_only", "http2_only", "randomize_addresses", "read_timeout"}


def factory(scheme: str):
    """The ``register_storage`` factory of ``scheme``: one storage (its clients, their connection
    pools) per distinct options and environment."""
    def make(**options) -> ObjectStorage:
        env = sorted((k, v) for k, v in os.environ.items()
                     if k.startswith(("AWS_", "GOOGLE_")) or k == "STORAGE_EMULATOR_HOST")
        key = (scheme, json.dumps([options, env], sort_keys=True, default=str))
        return cached(key, lambda: ObjectStorage(scheme, **options))
    return make


__all__ = ["ObjectStorage", "factory"]
