"""Plan styles: every value a plan may hold (transformers' and diffusers' style names, torch's
``ColwiseParallel`` / ``RowwiseParallel`` and diffusers' packed markers, read by name)
normalised to one ``Style``: how its tensors split and what the module's forward does around
its own code. Pure. docs/plans.md has each style's collectives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from shardwise.errors import PlanError


@dataclass(frozen=True)
class _Packed:
    blocks: Sequence[int] | None = None  # any sequence in; a tuple once constructed

    def __post_init__(self) -> None:
        if self.blocks is not None:
            object.__setattr__(self, "blocks", check_blocks(self.blocks, type(self).__name__))


@dataclass(frozen=True)
class PackedColwise(_Packed):
    """Column-wise split of a fused projection, each packed block on its own.

    ``blocks`` are ratios of the output rows (``[1, 1]`` for gate|up, ``[1, 1, 1, 3, 3]``
    for fused q|k|v|gate|up); ``None`` reads ``module._tp_packed_col_blocks``.

    >>> PackedColwise([1, 1])
    PackedColwise(blocks=(1, 1))
    """


@dataclass(frozen=True)
class PackedRowwise(_Packed):
    """Row-wise split of a projection whose input concatenates several blocks.

    ``blocks`` are ratios of the input columns (``[1, 3]`` when the input is an attention
    output next to an MLP hidden state 3x as wide); ``None`` reads
    ``module._tp_packed_row_blocks``.

    >>> PackedRowwise([1, 3])
    PackedRowwise(blocks=(1, 3))
    """


def check_blocks(blocks, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(b) for b in blocks)
    except (TypeError, ValueError):
        raise PlanError(f"{what} blocks must be a list of positive ints, got {blocks!r}") from None
    if not out or any(b <= 0 for b in out) or any(int(b) != b for b in blocks):
        raise PlanError(f"{what} blocks must be a non-empty list of positive ints, got {blocks!r}")
    return out


@dataclass(frozen=True)
class Style:
    """A normalised plan entry.

    ``kind`` is ``"colwise"`` (output features split), ``"rowwise"`` (input features
    split; the bias is replicated and added once, after the reduction) or ``"replicate"``.
    ``blocks`` are packed ratios (``None``: read them off the module). ``gather_output``
    all-gathers a colwise output back to full size; ``split_input`` takes a replicated
    input and splits it locally before a rowwise matmul; ``embedding`` marks the
    embedding styles (a parameter key then splits dim 0 for rowwise, dim 1 for colwise).
    ``axis`` is the mesh axis it shards over (``"ep"``: experts split on dim 0).

    ``forward`` is what the module's forward does besides its own code (``local_tp``
    implements each): ``linear`` (split by kind), ``none``, ``grad_allreduce`` (parameter
    gradients all-reduced over tp), ``local_params`` (runs on the local shards of its
    parameters), ``reduce_output`` (output all-reduced), ``moe_experts`` (each rank runs its
    part of every expert, outputs all-reduced), ``divide_input`` (input divided by the
    degree: an identity expert), ``mla_kv_a`` (the rotary part's gradient all-reduced; its
    width is ``rope_dim``), ``ep_experts`` (each ep rank runs its own ``num_experts`` share on
    the batch they share, outputs all-reduced over ep).
    """

    kind: str
    blocks: tuple[int, ...] | None = (1,)
    gather_output: bool = False
    split_input: bool = False
    source: str = ""
    forward: str = "linear"
    embedding: bool = False
    rope_dim: int | None = None
    num_experts: int | None = None
    axis: str = "tp"

    @property
    def sharded(self) -> bool:
        return self.kind != "replicate"


def _s(kind: str, **kw) -> Style:
    return Style(kind, **kw)


_STRINGS: dict[str, Style] = {
    "colwise": _s("colwise"),
    "local_colwise": _s("colwise"),
    "colwise_rep": _s("colwise", gather_output=True),
    "colwise_gather_output": _s("colwise", gather_output=True),
    "rowwise": _s("rowwise"),
    "local_rowwise": _s("rowwise"),
    "rowwise_split_input": _s("rowwise", split_input=True),
    "rowwise_rep": _s("rowwise", split_input=True),
    "embedding_rowwise": _s("rowwise", embedding=True),
    "vocab_parallel": _s("rowwise", embedding=True),
    "embedding_colwise": _s("colwise", embedding=True),
    "packed_colwise": _s("colwise", blocks=None),
    "packed_rowwise": _s("rowwise", blocks=None),
    "replicate": _s("replicate", forward="none"),
    "replicated": _s("replicate", forward="none"),
    "local": _s("replicate", forward="none"),
    "replicated_with_grad_allreduce": _s("replicate", forward="grad_allreduce"),
    # transformers' sequence_parallel runs its module on a shard of the sequence, so each
    # rank's gradient is partial and DTensor sums it. shardwise never shards the sequence:
    # the module sees the whole activation, its gradient is already whole on every rank,
    # and a sum over tp would count it degree times (it did: 2x at tp=2). Held like "local".
    "sequence_parallel": _s("replicate", forward="none"),
    "local_params": _s("replicate", forward="local_params"),
    "all_reduce": _s("replicate", forward="reduce_output"),
    "moe_tp_experts": _s("replicate", forward="moe_experts"),
    "moe_identity_expert": _s("replicate", forward="divide_input"),
    "mla_kv_a_proj": _s("replicate", forward="mla_kv_a"),
}
# Styles of an expert-parallel plan (transformers' base_model_ep_plan), on the ep axis.
_EP_STRINGS: dict[str, Style] = {
    "grouped_gemm": _s("colwise", axis="ep"),
    "ep_dispatch_experts": _s("replicate", forward="ep_experts", axis="ep"),
}
_STRINGS.update(_EP_STRINGS)
SUPPORTED_STYLES = tuple(sorted(_STRINGS)) + ("PackedColwise(blocks)", "PackedRowwise(blocks)")
# Default packed layout when a "packed_*" string names no blocks and the module carries
# none: transformers uses it for gate|up, two equal halves.
DEFAULT_PACKED = (1, 1)


def normalize_style(style, *, key: str = "") -> Style:
    """A plan value (string, packed object, torch ParallelStyle) as a ``Style``.

    >>> normalize_style("colwise_gather_output").gather_output
    True
    """
    where = f" for plan key {key!r}" if key else ""
    if isinstance(style, Style):
        return style
    if isinstance(style, str):
        if style in _STRINGS:
            return replace(_STRINGS[style], source=style)
        raise PlanError(f"unsupported style {style!r}{where}; supported: {', '.join(SUPPORTED_STYLES)}")
    cls = type(style).__name__
    blocks = getattr(style, "blocks", None)
    if cls in ("PackedColwise", "PackedColwiseParallel", "PackedRowwise", "PackedRowwiseParallel"):
        b = None if blocks is None else check_blocks(blocks, cls)
        kind = "colwise" if "Colwise" in cls else "rowwise"
        return Style(kind, b, source=f"{cls}({list(b) if b else None})")
    if cls == "ReplicatedInputRowwiseParallel":  # diffusers' name for rowwise_split_input
        return Style("rowwise", split_input=True, source=cls)
    if cls in ("ColwiseParallel", "RowwiseParallel"):
        return _from_torch_style(style, cls)
    raise PlanError(f"unsupported style {style!r}{where}; supported: {', '.join(SUPPORTED_STYLES)}")


def _from_torch_style(style, cls: str) -> Style:
    # torch keeps layouts as 1-tuples of placements
    layouts = getattr(style, "output_layouts" if cls == "ColwiseParallel" else "input_layouts", ())
    first = layouts[0] if isinstance(layouts, tuple) and layouts else layouts
    replicated = type(first).__name__ == "Replicate"
    if cls == "ColwiseParallel":
        return Style("colwise", gather_output=replicated, source=cls)
    return Style("rowwise", split_input=replicated, source=cls)


__all__ = [
    "DEFAULT_PACKED", "PackedColwise", "PackedRowwise", "SUPPORTED_STYLES", "Style",
    "check_blocks", "normalize_style",
]
