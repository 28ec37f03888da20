"""``sw.load_adapter`` with hub repo ids: ``"org/name"`` (no local path of that name) is read in
place from the hub at one pinned commit, found as ``sw.from_pretrained`` finds its folder
(``where_named``); every other path or URL goes to :func:`shardwise.adapters.load_adapter`."""

from __future__ import annotations

import os

from torch import nn

from shardwise import adapters
from shardwise.hf.pretrained import where_named
from shardwise.mesh import world_backend


def load_adapter(model: nn.Module, path: str | os.PathLike, *, adapter_name: str = "default",
                 revision: str | None = None, token: str | bool | None = None,
                 storage_options: dict | None = None, **options) -> adapters.AdapterResult:
    """:func:`shardwise.adapters.load_adapter`, where ``path`` may also be a hub repo id
    (``revision``: a branch, tag or commit, default ``"main"``; ``token``: for a private repo).
    Every rank calls it; the ranks agree on the commit before any byte is read.

    >>> sw.load_adapter(model, "org/style-lora", adapter_name="style")   # doctest: +SKIP
    """
    where = where_named(path, revision, token, storage_options, world_backend())
    return adapters.load_adapter(model, where, adapter_name=adapter_name, **options)


__all__ = ["load_adapter"]
