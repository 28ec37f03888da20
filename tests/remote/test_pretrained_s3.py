"""``sw.from_pretrained`` of transformers checkpoints (Llama-like, and Qwen3-MoE with a tied
head; ``save_pretrained`` into several files) from S3 (SeaweedFS) on spawned gloo ranks at tp=2
and tp=4: logits equal to the same load from the local folder, and the job fetches each tensor
byte once. Each rank talks to the store through its own counting proxy, so that what a rank
fetched is counted where it crossed the wire, not by the loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from proxy import RankProxies

import shardwise as sw
from shardwise.testing import spawn

pytest.importorskip("transformers")

SHARD_SIZE = "60KB"  # several files


def _model(kind: str):
    """``llama``: dense, untied head; ``qwen3_moe``: 4 experts a layer, the head tied to the
    embedding (saved once), q/k norms."""
    import transformers

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False))
    config = transformers.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, tie_word_embeddings=True)
    return transformers.Qwen3MoeForCausalLM(config)


def _save(folder: Path, kind: str = "llama") -> dict[str, int]:
    """The tiny model with seeded weights (norms too), saved; ``{file: offset of its data}``."""
    model = _model(kind)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(folder, max_shard_size=SHARD_SIZE)
    return {f.name: 8 + int.from_bytes(f.read_bytes()[:8], "little") for f in folder.glob("*.safetensors")}


def _logits(url: str, local: str, options: list[dict], tp: int) -> int:
    from transformers import AutoModelForCausalLM

    backend = sw.init_backend("gloo")
    mesh = backend.mesh(tp=tp)
    remote = sw.from_pretrained(AutoModelForCausalLM, url, mesh=mesh, storage_options=options[backend.rank])
    ours = sw.from_pretrained(AutoModelForCausalLM, local, mesh=mesh)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    if remote.config.tie_word_embeddings:  # tied after the load too, not two copies
        assert remote.get_output_embeddings().weight is remote.get_input_embeddings().weight
    with torch.no_grad():
        got, want = remote(input_ids=ids).logits, ours(input_ids=ids).logits
    if type(got).__name__ == "DTensor":
        got, want = got.full_tensor(), want.full_tensor()
    assert torch.equal(got, want), (got - want).abs().max()
    return remote.result.bytes_read


@pytest.mark.parametrize(("kind", "tp"), [("llama", 2), ("llama", 4), ("qwen3_moe", 2), ("qwen3_moe", 4)])
def test_from_pretrained_reads_each_byte_once(s3, tmp_path, kind, tp):
    import obstore

    folder = tmp_path / "ckpt"
    starts = _save(folder, kind)
    assert len(starts) > 2
    store = s3.storage().store(s3.bucket)
    for f in folder.iterdir():  # uploaded as they are: the files save_pretrained wrote
        obstore.put(store, f"{s3.prefix}/ckpt/{f.name}", f.read_bytes())
    total = sum(f.stat().st_size - starts[f.name] for f in folder.glob("*.safetensors"))
    from safetensors import safe_open

    tensors, rows = 0, 0
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                shape = handle.get_slice(name).get_shape()
                tensors, rows = tensors + 1, rows + (shape[0] if len(shape) == 2 else 0)

    with RankProxies(s3.server.endpoint, tp) as proxies:
        read = spawn(_logits, tp, args=(s3.url("ckpt"), str(folder), proxies.options(s3.options), tp),
                     timeout=300)
        fetched, data, gets = proxies.figures(starts)
    print(f"tp={tp}: {total} tensor bytes in {len(starts)} files, {tensors} tensors; per rank: fetched "
          f"{fetched}, tensor data {data}, loader's count {read}, GETs {gets}")
    assert sum(data) <= 1.05 * total  # the job fetched each tensor byte once
    assert all(d <= 1.05 * total / tp for d in data), (data, total / tp)  # each rank its share
    assert data == read  # what the loader counts is what crossed the wire
    # the rest: config.json, the index, each file's header, listings
    assert all(f - d <= 40_000 for f, d in zip(fetched, data, strict=True)), (fetched, data)
    # a rowwise slice no longer costs a GET per row: the GETs follow the tensors, not their rows
    assert max(gets) <= 2 * tensors + 4 * len(starts) + 8 < rows, (gets, tensors, rows)
