"""The T5 and UMT5 encoder plans shardwise ships (hf.encoder_plans): on 2 and 4 gloo ranks
sw.from_pretrained(T5EncoderModel | UMT5EncoderModel, folder, mesh=) gives the one-process
hidden states within 1e-5 (float32), every planned tensor split, each rank reading its slices."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402
from shardwise.mesh import get_shard_state  # noqa: E402

TOLERANCE = 1e-5
IDS = [[5, 17, 3, 250, 9, 41, 77, 2], [8, 1, 99, 12, 200, 6, 30, 2]]


def _config(kind: str):
    import transformers

    # 4 heads of 8, a gated (UMT5, T5 v1.1) or plain (T5) feed-forward, vocabulary split by 4
    common = {"vocab_size": 256, "d_model": 32, "d_kv": 8, "d_ff": 48, "num_layers": 3, "num_heads": 4,
              "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16,
              "dropout_rate": 0.0, "is_encoder_decoder": False, "use_cache": False}
    if kind == "t5":
        return transformers.T5EncoderModel, transformers.T5Config(**common, feed_forward_proj="relu")
    if kind == "t5_gated":
        return transformers.T5EncoderModel, transformers.T5Config(**common, feed_forward_proj="gated-gelu")
    return transformers.UMT5EncoderModel, transformers.UMT5Config(**common, feed_forward_proj="gated-gelu")


def build(kind: str, seed: int = 0):
    cls, config = _config(kind)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # every tensor seeded away from its init (norms and the bias too)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def hidden(model) -> torch.Tensor:
    ids = torch.tensor(IDS)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # a padded row: the mask and the bias meet in the scores
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state.float()


def _load(kind: str, ckpt: str) -> dict:
    backend = sw.init_backend("gloo")
    cls, _ = _config(kind)
    model = sw.from_pretrained(cls, ckpt, mesh=backend.mesh(tp=backend.world_size))
    split = sorted(n for n, s in get_shard_state(model).specs.items() if not s.replicated)
    attention = model.encoder.block[1].layer[0].SelfAttention
    return {"hidden": hidden(model).tolist(), "split": split, "read": model.result.bytes_read,
            "heads": attention.n_heads, "unused": list(model.result.unused_plan_keys)}


@pytest.mark.parametrize("kind,tp", [("t5", 2), ("t5_gated", 4), ("umt5", 2), ("umt5", 4)])
def test_encoder_matches_one_process(tmp_path, kind, tp):
    model = build(kind)
    model.save_pretrained(tmp_path / "ckpt")
    reference = hidden(model)
    whole = sum(t.numel() * t.element_size() for t in model.state_dict().values()
                if t.data_ptr() != model.shared.weight.data_ptr())  # the tied embedding once
    whole += model.shared.weight.numel() * 4
    rows = run_ranks(_load, tp, kind, str(tmp_path / "ckpt"), timeout=300)
    ff = ("wi_0", "wi_1", "wo") if kind != "t5" else ("wi", "wo")
    bias_layers = range(3) if kind == "umt5" else range(1)  # UMT5: a bias in every layer, T5 the first
    want = {"shared.weight"}  # encoder.embed_tokens.weight: tied to it
    for i in range(3):
        attention = f"encoder.block.{i}.layer.0.SelfAttention"
        want |= {f"{attention}.{p}.weight" for p in "qkvo"}
        want |= {f"encoder.block.{i}.layer.1.DenseReluDense.{p}.weight" for p in ff}
        if i in bias_layers:
            want.add(f"{attention}.relative_attention_bias.weight")
    for rank, row in enumerate(rows):
        diff = (torch.tensor(row["hidden"]) - reference).abs().max().item()
        assert diff <= TOLERANCE, (kind, tp, rank, diff)
        assert set(row["split"]) == want, sorted(want ^ set(row["split"]))
        assert row["heads"] == 4 // tp and row["unused"] == []
        # the split tensors' 1/tp and the norms whole: well under the whole model
        assert row["read"] < whole / tp + 4096, (row["read"], whole)
