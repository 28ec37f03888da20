"""A Hugging Face hub repo id (``"org/name"``) as a checkpoint location, as transformers'
``from_pretrained`` takes one: the revision resolved once to its commit, and the repo read in
place through fsspec's ``hf://`` filesystem (huggingface_hub's ``HfFileSystem``): the listing
from the hub's tree API, each object read by ranged GETs of
``{HF_ENDPOINT}/{repo_id}/resolve/{commit}/{filename}``, so that every rank fetches only the
bytes of its own slices and nothing is downloaded whole. The endpoint, the token and the
offline switch are huggingface_hub's (``HF_ENDPOINT``, ``HF_TOKEN``, ``HF_HUB_OFFLINE``).
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from shardwise.errors import CheckpointError, UsageError
from shardwise.io.storage import Location, locate, split_scheme

if TYPE_CHECKING:
    from shardwise.backends import Backend

# The hub's repo ids: a namespace and a name, letters, digits, "-", "_", "." (no "--", "..")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


def is_repo_id(path) -> bool:
    """Whether ``path`` names a hub repo: ``"org/name"``, no scheme, and no local path of that name."""
    return (isinstance(path, str) and split_scheme(path)[0] is None and _REPO_ID.fullmatch(path) is not None
            and "--" not in path and ".." not in path and not os.path.exists(path))


def hub_location(repo_id: str, *, revision: str | None, token: str | bool | None,
                 storage_options: dict | None, backend: Backend | None) -> Location:
    """The ``hf://{repo_id}@{commit}`` location of ``repo_id`` at ``revision`` (default
    ``"main"``), its commit resolved through the hub's API. Collective: every rank resolves it
    and the ranks compare, so that all of them read one commit (a branch that moves meanwhile
    is an error, never a mix), waiting as long as ``backend`` (the caller's, resolved at its
    public entry point; None: one process) allows. ``CheckpointError`` (on every rank) for an unknown repo or
    revision, one the token cannot see, or a hub that cannot be reached; no token is shown."""
    from shardwise.comm import agree, all_gather_object

    revision = revision or "main"
    commit, error = None, None
    try:
        commit = _commit(repo_id, revision, token)
    except CheckpointError as e:
        error = e
    agree(backend, error, what=f"resolving the hub repo {repo_id!r} at {revision!r}")
    commits = set(all_gather_object(commit, purpose="the hub commit")) if backend is not None else {commit}
    if len(commits) > 1:
        raise CheckpointError(f"{repo_id!r}: the revision {revision!r} moved while the ranks resolved it "
                              f"(commits {sorted(c for c in commits if c)}); pass revision=<a commit sha>")
    options = dict(storage_options or {})
    if token is not None:
        options["token"] = token
    return locate(f"hf://{repo_id}@{commit}", options)


def _commit(repo_id: str, revision: str, token: str | bool | None) -> str:
    try:
        from huggingface_hub import HfApi, constants
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
    except ImportError as e:
        raise UsageError(f"{repo_id!r} is read as a hub repo id, which needs huggingface_hub: "
                         "pip install huggingface_hub") from e
    where = f"{constants.ENDPOINT}"
    try:
        info = HfApi(token=token).model_info(repo_id, revision=revision)
    except RevisionNotFoundError:
        raise CheckpointError(f"the hub repo {repo_id!r} ({where}) has no revision {revision!r}; pass an "
                              "existing branch, tag or commit sha as revision=") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo_id!r}: no local folder of that name, and no model repo {repo_id!r} on "
                              f"{where} that this token can see; check the id, or pass token= (or set "
                              "HF_TOKEN) for a private or gated repo") from None
    except Exception as e:  # a token refused; offline mode, a connection refused, a 5xx
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise CheckpointError(f"{where} refused access to the hub repo {repo_id!r} (HTTP {status}): "
                                  "pass token= (or set HF_TOKEN) with read access to it") from None
        raise CheckpointError(f"{repo_id!r}: no local folder of that name, and as a hub repo id (revision "
                              f"{revision!r}) {where} could not serve it: {type(e).__name__}: "
                              f"{_scrub(e, token)}; offline, pass the downloaded folder instead") from None
    if not info.sha:
        raise CheckpointError(f"{where} gave no commit for {repo_id!r} at {revision!r}")
    return info.sha


def _scrub(error: Exception, token: str | bool | None) -> str:
    text = (str(error).strip().splitlines() or [""])[0]
    for secret in (token, os.environ.get("HF_TOKEN")):
        if isinstance(secret, str) and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


__all__ = ["hub_location", "is_repo_id"]
