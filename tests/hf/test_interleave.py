"""transformers 5.25's ``WeightConverter(Interleave)`` (Inkling2's ``w13`` tensors) as region math.

An interleave only moves rows (the evens, then the odds), so shardwise serves it as boxes of
the stored tensor; here each model tensor assembled from those boxes equals what transformers'
own operations make of the same stored tensor, for the fused experts (``Interleave(dim=1)``),
the split dense MLP (``Interleave(dim=0), Chunk(dim=0)``), the inverse, and a rank's share of
the result reads rows of both halves.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers.core_model_loading import Chunk, Interleave, WeightConverter  # noqa: E402

from shardwise.core.header import TensorEntry  # noqa: E402
from shardwise.errors import CheckpointError  # noqa: E402
from shardwise.hf.hub_layout import _apply, _split_targets, _whole  # noqa: E402
from shardwise.hf.hub_moves import Virtual  # noqa: E402


def _assemble(shape, pieces, stored: torch.Tensor) -> torch.Tensor:
    out = torch.full(shape, float("nan"))
    for p in pieces:
        box = stored[p.source.slices()]
        for d in sorted(p.stacked):
            box = box.unsqueeze(d)
        out[p.box().slices()] = box
    return out


@pytest.mark.parametrize(("shape", "dim", "inverse"), [((3, 8, 5), 1, False), ((3, 8, 5), 1, True),
                                                       ((6, 4), 0, False), ((4, 6), 1, False)])
def test_an_interleave_is_the_rows_transformers_moves(shape, dim, inverse):
    stored = torch.randn(shape)
    conv = WeightConverter(source_patterns="w13_weight", target_patterns="gate_up_proj",
                           operations=[Interleave(dim=dim, inverse=inverse)])
    want = Interleave(dim=dim, inverse=inverse).convert({"w": stored}, ["w"], ["t"])["t"]
    built = _apply(conv, {"w13_weight": [Virtual(shape, [_whole("k", shape)])]}, "model tensor 't'")
    got = _assemble(built.shape, built.pieces, stored)
    assert torch.equal(got, want)
    # and back: the inverse op of the result gives the stored rows
    reverse = conv.operations[0].reverse_op
    undo = WeightConverter(source_patterns="a", target_patterns="b", operations=[reverse])
    back = _apply(undo, {"a": [built]}, "back")
    assert torch.equal(_assemble(back.shape, back.pieces, stored), stored)


def test_interleave_then_chunk_gives_each_target_rows_of_both_halves():
    stored = torch.randn(8, 3)  # mlp.w13_dn.weight: gate and up rows interleaved
    conv = WeightConverter(source_patterns="mlp.w13_dn.weight",
                           target_patterns=["mlp.gate_proj.weight", "mlp.up_proj.weight"],
                           operations=[Interleave(dim=0), Chunk(dim=0)])
    want = stored.reshape(4, 2, 3).transpose(0, 1).reshape(8, 3)
    entry = TensorEntry("k", "F32", (8, 3), 0, 96)
    parts = _split_targets(conv, "k", "mlp.gate_proj.weight", entry, {}, "stored tensor 'k'")
    assert list(parts) == ["mlp.gate_proj.weight", "mlp.up_proj.weight"]
    gate, up = (_assemble(v.shape, v.pieces, stored) for v in parts.values())
    assert torch.equal(gate, want[:4]) and torch.equal(up, want[4:])
    assert torch.equal(gate, stored[0::2]) and torch.equal(up, stored[1::2])


def test_inkling2s_unpadded_vocab_is_the_first_rows():
    from transformers.core_model_loading import Inkling2UnpadVocab

    stored = torch.randn(10, 4)  # lm_head padded to vocab_size 10; the model keeps 7 rows
    conv = WeightConverter(source_patterns="lm_head.weight", target_patterns="lm_head.weight",
                           operations=[Inkling2UnpadVocab()])
    built = _apply(conv, {"lm_head.weight": [Virtual((10, 4), [_whole("k", (10, 4))])]}, "lm_head", (7, 4))
    assert built.shape == (7, 4) and torch.equal(_assemble(built.shape, built.pieces, stored), stored[:7])


def test_inkling2_loops_merged_message_queries_are_rows_of_the_two_stored_tensors():
    # Inkling2LoopMergeMessageQueries only moves rows: (2L, H) queries and kv queries into (L, 4, H)
    from transformers.core_model_loading import Inkling2LoopMergeMessageQueries

    queries, kv = torch.randn(6, 5), torch.randn(6, 5)
    sources = ["middle_cycle_cross_pass_queries", "middle_cycle_cross_pass_kv_queries"]
    conv = WeightConverter(source_patterns=sources, target_patterns="message_input.query",
                           operations=[Inkling2LoopMergeMessageQueries()])
    want = Inkling2LoopMergeMessageQueries().convert({sources[0]: queries, sources[1]: kv}, sources,
                                                     ["t"])["t"]
    groups = {sources[0]: [Virtual((6, 5), [_whole("q", (6, 5))])],
              sources[1]: [Virtual((6, 5), [_whole("kv", (6, 5))])]}
    built = _apply(conv, groups, "model tensor 'message_input.query'")
    assert built.shape == tuple(want.shape) == (3, 4, 5)
    got = torch.full(built.shape, float("nan"))
    for p in built.pieces:
        got[p.box().slices()] = {"q": queries, "kv": kv}[p.key][p.source.slices()].unsqueeze(1)
    assert torch.equal(got, want)
    with pytest.raises(CheckpointError, match="two .* tensors of one shape"):
        _apply(conv, {sources[0]: [Virtual((5, 5), [_whole("q", (5, 5))])],
                      sources[1]: [Virtual((6, 5), [_whole("kv", (6, 5))])]}, "odd")
