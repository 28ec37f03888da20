"""``sw.load_adapter`` with hub repo ids: ``"org/name"`` (no local path of that name) is read in
place from the hub at one pinned commit, as ``sw.from_pretrained`` reads one (``hub_location``);
every other path or URL goes to :func:`shardwise.adapters.load_adapter` as it is."""

from __future__ import annotations

import os
from typing import cast

from torch import nn

from shardwise import adapters
from shardwise.errors import UsageError
from shardwise.hf.pretrained import hub_location, is_repo_id
from shardwise.mesh import world_backend


def load_adapter(model: nn.Module, path: str | os.PathLike, *, adapter_name: str = "default",
                 revision: str | None = None, token: str | bool | None = None,
                 storage_options: dict | None = None, **options) -> adapters.AdapterResult:
    """:func:`shardwise.adapters.load_adapter`, where ``path`` may also be a hub repo id
    (``revision``: a branch, tag or commit, default ``"main"``; ``token``: for a private repo).
    Every rank calls it; the ranks agree on the commit before any byte is read.

    >>> sw.load_adapter(model, "org/style-lora", adapter_name="style")   # doctest: +SKIP
    """
    if is_repo_id(path):
        where = hub_location(cast(str, path), revision=revision, token=token,
                             storage_options=storage_options, backend=world_backend())
        return adapters.load_adapter(model, where, adapter_name=adapter_name, **options)
    if revision is not None or token is not None:
        raise UsageError(f"revision= and token= go with a hub repo id ('org/name'); {os.fspath(path)!r} is "
                         "a local path or a URL")
    return adapters.load_adapter(model, path, adapter_name=adapter_name, storage_options=storage_options,
                                 **options)


__all__ = ["load_adapter"]
