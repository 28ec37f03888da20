"""Hugging Face models: the adapter (``hf.adapter``, registered by ``import shardwise``) and the
front door (``sw.from_pretrained``, ``sw.empty_model``: ``hf.pretrained``, imported on first use)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise.hf.pretrained import empty_model as empty_model
    from shardwise.hf.pretrained import from_pretrained as from_pretrained
    from shardwise.hf.pretrained import mxfp4_experts as mxfp4_experts

_FRONT_DOOR = ("empty_model", "from_pretrained", "mxfp4_experts")


def __getattr__(name: str):
    if name in _FRONT_DOOR:
        # deferred: the load path costs ~1.6 s of CPU, which `import shardwise` must not pay
        from shardwise.hf import pretrained

        return getattr(pretrained, name)
    raise AttributeError(f"module 'shardwise.hf' has no attribute {name!r}")


__all__ = list(_FRONT_DOOR)
