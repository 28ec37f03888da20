"""The layouts a world size allows, and where each one reshards to. Pure.

Four kinds, each at most once per world: ``tp`` (tensor parallel over every device),
``dp_shard x tp`` (FSDP2 over the loaded TP shards), ``dp_replicate x tp`` (replicas of the
TP model) and ``ep x tp`` (experts split over ``ep``, the rest over ``tp``). A tp degree must
divide the model's KV heads (``max_tp``), an ep degree its experts.

>>> [l.name for l in layouts_for(4)]
['tp4', 'dp_shard2_tp2', 'dp_replicate2_tp2', 'ep2_tp2', 'ep4_tp1']
>>> [l.name for l in layouts_for(1)]
['tp1']
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.testing.model import CONFIG, MAX_TP


@dataclass(frozen=True)
class Layout:
    """One mesh request: ``axes`` as ``backend.mesh(**axes)`` takes them, outer to inner."""

    axes: tuple[tuple[str, int], ...]

    @property
    def name(self) -> str:
        return "_".join(f"{a}{n}" for a, n in self.axes)

    @property
    def mesh_axes(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def world(self) -> int:
        n = 1
        for _, size in self.axes:
            n *= size
        return n

    def has(self, axis: str) -> bool:
        return self.mesh_axes.get(axis, 1) > 1

    def __repr__(self) -> str:
        return f"Layout({self.name})"


def _layout(**axes: int) -> Layout:
    order = ("dp_replicate", "dp_shard", "ep", "tp")
    return Layout(tuple((a, axes[a]) for a in order if a in axes))


def _tp_fits(tp: int, max_tp: int) -> bool:
    return max_tp % tp == 0


def layouts_for(world: int, *, max_tp: int = MAX_TP, num_experts: int = CONFIG.num_experts) -> list[Layout]:
    """Every layout kind that ``world`` devices allow for the model, in the order they run.

    The two-axis layouts take the largest tp below ``world`` that divides both the world and
    ``max_tp``, and the rest of the world for the outer axis. A world that ``max_tp`` does not
    divide (16 devices, 8 KV heads) has no pure ``tp`` layout; an ep layout needs an ep degree
    that divides the experts.
    """
    out = []
    if _tp_fits(world, max_tp):
        out.append(_layout(tp=world))
    if world == 1:
        return out
    tp = max(t for t in range(1, world) if world % t == 0 and _tp_fits(t, max_tp))
    outer = world // tp
    out.append(_layout(dp_shard=outer, tp=tp))
    out.append(_layout(dp_replicate=outer, tp=tp))
    if num_experts % outer == 0:
        out.append(_layout(ep=outer, tp=tp))
    if tp > 1 and num_experts % world == 0:  # pure expert parallel
        out.append(_layout(ep=world, tp=1))
    return out


def reshard_target(layouts: list[Layout], index: int) -> Layout:
    """The layout a checkpoint written at ``layouts[index]`` is reloaded at: the next one (a
    different layout whenever the world allows more than one)."""
    return layouts[(index + 1) % len(layouts)]


__all__ = ["Layout", "layouts_for", "reshard_target"]
