"""Where a LoRA pair's shards lie (pure): each follows its base layer's shard spec.

A linear base of weight ``[out, in]`` adapted by ``lora_A [r, in]`` and ``lora_B [out, r]``: a
colwise base splits ``lora_B`` like its output dim (per block when packed) and keeps ``lora_A``
whole; a rowwise base splits ``lora_A`` like its input dim and keeps ``lora_B`` whole. A
vocab-parallel embedding ``[V, D]`` adapted by ``lora_embedding_A [r, V]`` and
``lora_embedding_B [D, r]`` splits ``A`` on the vocab dim. An expert tensor ``[E, ., .]`` adapted
through PEFT's ``target_parameters`` has ``lora_A [r * E, in]`` (expert-major rows) and
``lora_B [out, r * E]`` (expert-minor columns): split over ep, ``A`` takes each rank's rows and
``B`` the same experts out of each of its ``r`` column blocks.

>>> from shardwise.core.styles import Style
>>> lora_specs("linear", Style("colwise"), ShardSpec(dim=0, blocks=(2, 1, 1)))
{'A': ShardSpec(replicated), 'B': ShardSpec(dim=0, blocks=(2, 1, 1))}
>>> lora_specs("linear", Style("rowwise"), ShardSpec(dim=1))
{'A': ShardSpec(dim=1, blocks=(1,)), 'B': ShardSpec(replicated)}
>>> expert_lora_specs(ShardSpec(dim=0, axis="ep"), r=2)
{'A': ShardSpec(dim=0, blocks=(1,), axis='ep'), 'B': ShardSpec(dim=1, blocks=(1, 1), axis='ep')}
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


def expert_lora_specs(base: ShardSpec, r: int, *, where: str = "") -> dict[str, ShardSpec]:
    """``{"A": spec, "B": spec}`` of PEFT's LoRA pair on an expert tensor (``target_parameters``)
    of rank ``r`` whose weight spec is ``base``; ``PlanError`` for a split other than whole experts."""
    if base.replicated:
        return {"A": WHOLE, "B": WHOLE}
    if base.dim != 0 or base.packed:
        raise PlanError(f"{where}: LoRA on an expert tensor split on dim {base.dim} over {base.axis!r} (not "
                        "whole experts) is not supported yet; load the experts with an ep plan (whole "
                        "experts per rank) or leave them out of the adapter's target_parameters")
    return {"A": ShardSpec(dim=0, axis=base.axis), "B": ShardSpec(dim=1, blocks=(1,) * r, axis=base.axis)}


__all__ = ["WHOLE", "expert_lora_specs", "lora_specs"]
