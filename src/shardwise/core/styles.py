"""Plan styles: every value a plan may hold (transformers' and diffusers' names, torch's and
diffusers' style objects, read by name) as one ``Style`` (pure; docs/plans.md: collectives)."""

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
    """Column-wise split of a fused projection, each block of output-row ratios ``blocks``
    (``[1, 1]``: gate|up) on its own; ``None`` reads ``module._tp_packed_col_blocks``.

    >>> PackedColwise([1, 1])
    PackedColwise(blocks=(1, 1))
    """


@dataclass(frozen=True)
class PackedRowwise(_Packed):
    """Row-wise split of a projection whose input concatenates blocks of input-column ratios
    ``blocks``; ``None`` reads ``module._tp_packed_row_blocks``.

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
    """A normalised plan entry: ``kind`` ``"colwise"`` (output features split), ``"rowwise"``
    (input features split, bias added once after the sum) or ``"replicate"``; ``blocks``: packed
    ratios (None: the module's); ``gather_output`` / ``split_input``: a whole output / input;
    ``embedding``: a parameter key splits dim 0 (rowwise) or 1; ``axis``: ``"tp"`` or ``"ep"``.
    ``forward``: what ``local_tp`` does around the module's own code (``linear``, ``none``,
    ``grad_allreduce``, ``local_params``, ``reduce_output``, ``moe_experts``, ``divide_input``,
    ``mla_kv_a`` of width ``rope_dim``, ``ep_experts`` of ``num_experts``); docs/plans.md."""

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


_STRINGS: dict[str, Style] = {
    "colwise": Style("colwise"),
    "local_colwise": Style("colwise"),
    "colwise_rep": Style("colwise", gather_output=True),
    "colwise_gather_output": Style("colwise", gather_output=True),
    "rowwise": Style("rowwise"),
    "local_rowwise": Style("rowwise"),
    "rowwise_split_input": Style("rowwise", split_input=True),
    "rowwise_rep": Style("rowwise", split_input=True),
    "embedding_rowwise": Style("rowwise", embedding=True),
    "vocab_parallel": Style("rowwise", embedding=True),
    "embedding_colwise": Style("colwise", embedding=True),
    "packed_colwise": Style("colwise", blocks=None),
    "packed_rowwise": Style("rowwise", blocks=None),
    "replicate": Style("replicate", forward="none"),
    "replicated": Style("replicate", forward="none"),
    "local": Style("replicate", forward="none"),
    "replicated_with_grad_allreduce": Style("replicate", forward="grad_allreduce"),
    # transformers' sequence_parallel sums partial gradients of a sequence shard; shardwise never
    # splits the sequence, so a sum over tp would count the whole gradient degree times
    "sequence_parallel": Style("replicate", forward="none"),
    "local_params": Style("replicate", forward="local_params"),
    "all_reduce": Style("replicate", forward="reduce_output"),
    "moe_tp_experts": Style("replicate", forward="moe_experts"),
    "moe_identity_expert": Style("replicate", forward="divide_input"),
    "mla_kv_a_proj": Style("replicate", forward="mla_kv_a"),
    # an expert-parallel plan's (transformers' base_model_ep_plan), on the ep axis
    "grouped_gemm": Style("colwise", axis="ep"),
    "ep_dispatch_experts": Style("replicate", forward="ep_experts", axis="ep"),
}
SUPPORTED_STYLES = tuple(sorted(_STRINGS)) + ("PackedColwise(blocks)", "PackedRowwise(blocks)")
# a "packed_*" string's blocks when the module carries none: transformers' gate|up halves
DEFAULT_PACKED = (1, 1)


def normalize_style(style, *, key: str = "") -> Style:
    """A plan value (string, packed object, torch ParallelStyle) as a ``Style``; else ``PlanError``.

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
        # torch keeps layouts as 1-tuples of placements
        layouts = getattr(style, "output_layouts" if cls == "ColwiseParallel" else "input_layouts", ())
        first = layouts[0] if isinstance(layouts, tuple) and layouts else layouts
        replicated = type(first).__name__ == "Replicate"
        if cls == "ColwiseParallel":
            return Style("colwise", gather_output=replicated, source=cls)
        return Style("rowwise", split_input=replicated, source=cls)
    raise PlanError(f"unsupported style {style!r}{where}; supported: {', '.join(SUPPORTED_STYLES)}")


__all__ = [
    "DEFAULT_PACKED", "PackedColwise", "PackedRowwise", "SUPPORTED_STYLES", "Style",
    "check_blocks", "normalize_style",
]
