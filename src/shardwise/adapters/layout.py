"""Where a LoRA pair's shards lie (pure): each follows its base layer's shard spec.

A linear base of weight ``[out, in]`` adapted by ``lora_A [r, in]`` and ``lora_B [out, r]``: a
colwise base splits ``lora_B`` like its output dim (per block when packed) and keeps ``lora_A``
whole; a rowwise base splits ``lora_A`` like its input dim and keeps ``lora_B`` whole. A
vocab-parallel embedding ``[V, D]`` adapted by ``lora_embedding_A [r, V]`` and
``lora_embedding_B [D, r]`` splits ``A`` on the vocab dim.

>>> from shardwise.core.styles import Style
>>> lora_specs("linear", Style("colwise"), ShardSpec(dim=0, blocks=(2, 1, 1)))
{'A': ShardSpec(replicated), 'B': ShardSpec(dim=0, blocks=(2, 1, 1))}
>>> lora_specs("linear", Style("rowwise"), ShardSpec(dim=1))
{'A': ShardSpec(dim=1, blocks=(1,)), 'B': ShardSpec(replicated)}
"""

from __future__ import annotations

from shardwise.core.spec import ShardSpec
from shardwise.core.styles import Style
from shardwise.errors import PlanError

WHOLE = ShardSpec()


def lora_specs(kind: str, style: Style | None, base: ShardSpec, *, where: str = "") -> dict[str, ShardSpec]:
    """``{"A": spec, "B": spec}`` of the LoRA pair on a base of ``kind`` (``"linear"`` or
    ``"embedding"``) held by ``style`` with weight spec ``base``; ``PlanError`` for a holding
    a LoRA pair cannot follow yet (named by ``where``)."""
    if style is None or not style.sharded or base.replicated:
        return {"A": WHOLE, "B": WHOLE}
    if base.axis != "tp":
        raise PlanError(f"{where}: LoRA on a module split over the {base.axis!r} axis is not supported yet; "
                        "leave it out of the adapter's target_modules")
    if kind == "embedding":
        if base.dim != 0:
            raise PlanError(f"{where}: LoRA on an embedding split on its embedding dim is not supported; "
                            "shard the embedding on the vocab dim (embedding_rowwise) or leave it out of "
                            "target_modules")
        return {"A": ShardSpec(dim=1, blocks=base.blocks), "B": WHOLE}
    if base.dim == 0:
        return {"A": WHOLE, "B": ShardSpec(dim=0, blocks=base.blocks)}
    if base.dim == 1:
        return {"A": ShardSpec(dim=1, blocks=base.blocks), "B": WHOLE}
    raise PlanError(f"{where}: a linear weight split on dim {base.dim} has no LoRA layout")


__all__ = ["WHOLE", "lora_specs"]
