"""A remote store's faults in words: the text of an obstore or fsspec exception (a Rust error
chain of several hundred characters, an S3 XML body, an aiohttp error) read for what went wrong,
and said as one sentence that names the fix. ``objects.retried`` calls :func:`in_words` on every
fault it gives up on, so each storage over a network (``objects``, ``fsspec``) says them alike.

The causes told apart, each with its fix: a bucket that does not exist (``NoSuchBucketError``;
a save makes it where the store allows, ``ObstorePublish._make_bucket``), no credentials found
(the client fell back to the cloud's instance metadata service), a plain ``http://`` endpoint
without ``AWS_ALLOW_HTTP``, access denied (a wrong key or a missing permission), an endpoint
that does not answer (refused, no such host, timed out). Anything else is its first line, with the XML
body's code and message when the server sent one (the line ends before them).
"""

from __future__ import annotations

import re

from shardwise.errors import CheckpointError

_ENDPOINT = re.compile(r"\b(https?)://([^/\s?\"]+)")
_XML = re.compile(r"<Code>([^<]+)</Code>\s*(?:<Message>([^<]*)</Message>)?")
# the instance metadata services a client asks for credentials when none are configured (by host,
# or by the path of their API where an endpoint is set: metadata_endpoint)
_METADATA = ("169.254.169.254", "metadata.google.internal", "169.254.170.2", "/latest/api/token",
             "/latest/meta-data", "computeMetadata")
_DENIED_CODES = {"AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "InvalidToken",
                 "ExpiredToken", "AllAccessDisabled", "AccountProblem"}
_UNREACHABLE = (("dns error", "no such host (DNS lookup failed)"),
                ("name or service not known", "no such host (DNS lookup failed)"),
                ("connection refused", "connection refused"),
                ("cannot connect to host", "connection refused"),
                ("operation timed out", "connection timed out"),
                ("tcp connect error", "connection failed"),
                ("error sending request", "connection failed"))


class StoreAccessError(CheckpointError):
    """The store refused every request or did not answer (no bucket, no or wrong credentials,
    plain http refused, unreachable): nothing at the location could be read, whatever it holds."""


class NoSuchBucketError(StoreAccessError):
    """A request to a bucket that does not exist (``bucket`` names it)."""

    def __init__(self, message: str, bucket: str):
        super().__init__(message)
        self.bucket = bucket


def in_words(error: object, what: str, scrub) -> CheckpointError:
    """The ``CheckpointError`` that says why ``what`` (a request, naming its URL) failed with
    ``error``, and how to fix it; ``scrub(text)`` gives the first line of a text with every
    secret blanked, and the message passes through it."""
    said = _said(error, what, scrub)
    said.args = (scrub(said.args[0]),)
    return said


def _said(error: object, what: str, scrub) -> CheckpointError:
    text = str(error)
    lower = text.lower()
    scheme, endpoint = _where(text)
    env = "GOOGLE" if "gs://" in what else "AWS"
    xml = _XML.search(text)
    code = xml.group(1) if xml else ""
    if code == "NoSuchBucket" or (code == "" and "bucket" in lower and "not found" in lower
                                  and "404" in text):
        bucket = _bucket(what)
        return NoSuchBucketError(f"{what}: the bucket {bucket!r} does not exist; "
                                 f"{make_command(what, bucket)}", bucket)
    if any(host in text for host in _METADATA):
        return StoreAccessError(f"{what}: no credentials found (the client fell back to the cloud's "
                                f"instance metadata service, which did not answer with any): "
                                f"{_credentials_fix(env)}")
    if "builder error" in lower and scheme == "http":
        return StoreAccessError(f"{what}: the endpoint {scheme}://{endpoint} is plain http, which the client "
                                f"refuses unless told: export {env}_ALLOW_HTTP=true (or pass "
                                "storage_options={'allow_http': True}); use https:// for anything but a "
                                "local test server")
    if code in _DENIED_CODES or type(error).__name__ in ("PermissionDeniedError", "UnauthenticatedError",
                                                         "PermissionError") \
            or (re.search(r"\b(401|403)\b(?![.,]\d)", text) and not re.search(r"\b5\d\d\b(?![.,]\d)", text)):
        # a status, not a duration ("retries in 403.2ms"); a store that answered 5xx (busy, down)
        # did not deny: its own text, below
        why = f" ({code}: {xml.group(2).strip()})" if xml and xml.group(2) else (f" ({code})" if code else "")
        keys = ("GOOGLE_SERVICE_ACCOUNT or GOOGLE_APPLICATION_CREDENTIALS" if env == "GOOGLE" else
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or storage_options access_key_id and "
                "secret_access_key")
        return StoreAccessError(f"{what}: access denied{why}: check the credentials ({keys}) and that "
                                "they may read, list and write this bucket")
    for needle, said in _UNREACHABLE:
        if needle in lower:
            at = f"{scheme}://{endpoint}" if endpoint else "the endpoint"
            fix = (f"check {env}_ENDPOINT_URL (or storage_options 'endpoint') and that the server runs"
                   if env == "AWS" else "check STORAGE_EMULATOR_HOST or the network")
            return StoreAccessError(f"{what}: cannot reach {at}: {said}; {fix}")
    detail = scrub(error)
    if xml and xml.group(1) not in detail:
        detail += f" {xml.group(1)}" + (f": {xml.group(2).strip()}" if xml.group(2) else "")
    return CheckpointError(f"{what}: {detail}")


def make_command(what: str, bucket: str) -> str:
    """The one command that makes ``bucket``, said as the fix."""
    if "gs://" in what:
        return f"make it with `gcloud storage buckets create gs://{bucket}`"
    return (f"make it with `aws s3 mb s3://{bucket}` (add `--endpoint-url $AWS_ENDPOINT_URL` for an "
            "S3-compatible server), or save to a bucket that exists")


def _credentials_fix(env: str) -> str:
    if env == "GOOGLE":
        return ("set GOOGLE_SERVICE_ACCOUNT or GOOGLE_APPLICATION_CREDENTIALS to a key file, "
                "STORAGE_EMULATOR_HOST for an emulator, or pass storage_options={'service_account_key': ...}")
    return ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or pass storage_options={'access_key_id': "
            "..., 'secret_access_key': ...})")


def _where(text: str) -> tuple[str, str]:
    """The scheme and host:port of the first URL in ``text`` that is not a metadata service."""
    for m in _ENDPOINT.finditer(text):
        if not any(text[m.start():].split()[0].count(mark) for mark in _METADATA):
            return m.group(1), m.group(2)
    return "", ""


def _bucket(what: str) -> str:
    m = re.search(r"\b(?:s3|gs)://([^/\s]+)", what)
    return m.group(1) if m else "?"


__all__ = ["NoSuchBucketError", "StoreAccessError", "in_words", "make_command"]
