"""Hugging Face models: the front door (``sw.from_pretrained``, ``sw.empty_model``, in
``hf.pretrained``) and the one adapter that holds what shardwise knows of transformers and
diffusers (``hf.adapter``: plans, key layouts, side files, guards, known-model checks).

``import shardwise`` imports ``hf.adapter`` to register it; the front door, which reaches
``sw.load``, is imported on first use of its names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise.hf.pretrained import empty_model as empty_model
    from shardwise.hf.pretrained import from_pretrained as from_pretrained
    from shardwise.hf.pretrained import mxfp4_experts as mxfp4_experts

_FRONT_DOOR = ("empty_model", "from_pretrained", "mxfp4_experts")


def __getattr__(name: str):
    if name in _FRONT_DOOR:
        # Deferred for import time: the front door imports the whole load path (io.load and
        # its formats, ~1.6 s of CPU measured), which `import shardwise` (it imports hf.adapter)
        # must not pay.
        from shardwise.hf import pretrained

        return getattr(pretrained, name)
    raise AttributeError(f"module 'shardwise.hf' has no attribute {name!r}")


__all__ = list(_FRONT_DOOR)
