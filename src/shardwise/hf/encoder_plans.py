"""Tensor-parallel plans shardwise ships for transformers models that ship none (T5 and UMT5
encoders: Flux.1's, Wan's, many pipelines' text encoders). ``HuggingFace.shipped_plan`` answers
with them for ``plan="auto"`` when the model's own attributes and config give no plan; the zoo
(benchmarks/zoo.py) checks them like the libraries' plans.

Attention: q, k, v colwise and o rowwise, so each rank computes whole heads. T5's relative
attention bias (an embedding of ``num_buckets x num_heads``) is added to each head's scores: it
is head-sharded with q/k/v (its weight split on dim 1, the lookup kept local), so each rank adds
the bias of its own heads; a replicated one would add every head's bias to the local heads (a
broadcast error or a wrong sum). The attention modules get ``local_heads``: UMT5 shapes q/k/v
with ``self.n_heads``, and both build a zero bias of ``self.n_heads`` heads for a layer without
one. Feed-forward: ``wi`` (or gated ``wi_0`` / ``wi_1``) colwise, ``wo`` rowwise. The vocabulary
embedding (``shared`` and the encoder's tied ``embed_tokens``) is split by rows (vocab parallel).
The decoders of the seq2seq classes are not planned (they stay whole).
"""

from __future__ import annotations

_ATTENTION = "encoder.block.*.layer.0.SelfAttention"
_FEED_FORWARD = "encoder.block.*.layer.1.DenseReluDense"

T5_ENCODER_PLAN = {
    "shared": "embedding_rowwise",
    "encoder.embed_tokens": "embedding_rowwise",
    _ATTENTION: "local_heads",
    f"{_ATTENTION}.q": "colwise",
    f"{_ATTENTION}.k": "colwise",
    f"{_ATTENTION}.v": "colwise",
    f"{_ATTENTION}.o": "rowwise",
    f"{_ATTENTION}.relative_attention_bias.weight": "embedding_colwise",
    f"{_FEED_FORWARD}.wo": "rowwise",
}
# the feed-forward's input projections, as the config's is_gated_act builds them
_PLAIN_FF = {f"{_FEED_FORWARD}.wi": "colwise"}
_GATED_FF = {f"{_FEED_FORWARD}.wi_0": "colwise", f"{_FEED_FORWARD}.wi_1": "colwise"}

# the transformers classes with a plan here; T5 and UMT5 have the same module names
CLASSES = ("T5EncoderModel", "UMT5EncoderModel")


def encoder_plan(model: object) -> dict:
    """The plan shardwise ships for the transformers model ``model`` (by its class name, its
    config's ``is_gated_act`` picking the feed-forward's keys); ``{}`` when none."""
    if type(model).__name__ not in CLASSES:
        return {}
    gated = bool(getattr(getattr(model, "config", None), "is_gated_act", False))
    return {**T5_ENCODER_PLAN, **(_GATED_FF if gated else _PLAIN_FF)}


__all__ = ["CLASSES", "T5_ENCODER_PLAN", "encoder_plan"]
