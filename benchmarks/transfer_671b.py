"""The offline transfer plan of a DeepSeek-V3-shaped 671B model: what one weight sync moves.

    python3 benchmarks/transfer_671b.py

No tensor is allocated: ``shardwise.transfer.offline_plan`` computes the plan from shapes,
shard specs and mesh degrees. The trainer holds the model in float32 under FSDP2 x TP
(``dp_shard=8, tp=8``: 64 ranks, 8 per node); the inference engine holds it in bfloat16 at
tp=8 in 8 replicas (``dp_replicate=8, tp=8``), either on the same 64 ranks (a hybrid
engine) or on 64 other ranks. Writes the ``transfer-671b`` section of docs/benchmarks.md
(bytes per link kind, the busiest rank, the buckets) and each plan as ``print(plan)`` prints
it into docs/transfer-671b.md.
"""

from __future__ import annotations

import time

from _common import REPO, machine_info, write_results

import shardwise as sw
from shardwise.transfer import MeshLayout, by_link, offline_plan, rank_loads

HIDDEN, VOCAB, LAYERS, DENSE, EXPERTS = 7168, 129280, 61, 3, 256
HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 128, 1536, 512, 128, 64, 128
INTER, MOE_INTER = 18432, 2048


def tensors() -> dict[str, tuple[tuple[int, ...], sw.ShardSpec]]:
    """DeepSeek-V3's parameters (experts stacked, as transformers holds them) with a TP plan."""
    rep, col, row = sw.ShardSpec(), sw.ShardSpec(dim=0), sw.ShardSpec(dim=1)
    out = {"model.embed_tokens.weight": ((VOCAB, HIDDEN), col), "model.norm.weight": ((HIDDEN,), rep),
           "lm_head.weight": ((VOCAB, HIDDEN), col)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        out |= {f"{p}.input_layernorm.weight": ((HIDDEN,), rep),
                f"{p}.post_attention_layernorm.weight": ((HIDDEN,), rep),
                f"{p}.self_attn.q_a_proj.weight": ((Q_LORA, HIDDEN), rep),
                f"{p}.self_attn.q_a_layernorm.weight": ((Q_LORA,), rep),
                f"{p}.self_attn.q_b_proj.weight": ((HEADS * (NOPE + ROPE), Q_LORA), col),
                f"{p}.self_attn.kv_a_proj_with_mqa.weight": ((KV_LORA + ROPE, HIDDEN), rep),
                f"{p}.self_attn.kv_a_layernorm.weight": ((KV_LORA,), rep),
                f"{p}.self_attn.kv_b_proj.weight": ((HEADS * (NOPE + V_DIM), KV_LORA), col),
                f"{p}.self_attn.o_proj.weight": ((HIDDEN, HEADS * V_DIM), row)}
        if i < DENSE:
            out |= {f"{p}.mlp.gate_proj.weight": ((INTER, HIDDEN), col),
                    f"{p}.mlp.up_proj.weight": ((INTER, HIDDEN), col),
                    f"{p}.mlp.down_proj.weight": ((HIDDEN, INTER), row)}
            continue
        out |= {f"{p}.mlp.gate.weight": ((EXPERTS, HIDDEN), rep),
                f"{p}.mlp.gate.e_score_correction_bias": ((EXPERTS,), rep),
                f"{p}.mlp.experts.gate_up_proj": ((EXPERTS, 2 * MOE_INTER, HIDDEN),
                                                  sw.ShardSpec(dim=1, blocks=(1, 1))),
                f"{p}.mlp.experts.down_proj": ((EXPERTS, HIDDEN, MOE_INTER), sw.ShardSpec(dim=2)),
                f"{p}.mlp.shared_experts.gate_proj.weight": ((MOE_INTER, HIDDEN), col),
                f"{p}.mlp.shared_experts.up_proj.weight": ((MOE_INTER, HIDDEN), col),
                f"{p}.mlp.shared_experts.down_proj.weight": ((HIDDEN, MOE_INTER), row)}
    return out


def main() -> None:
    model = tensors()
    params = sum(_numel(shape) for shape, _ in model.values())
    src = MeshLayout(dp_shard=8, tp=8)
    rows, summaries = [], []
    for where, dst in (("same 64 ranks", MeshLayout(dp_replicate=8, tp=8)),
                       ("64 other ranks", MeshLayout(dp_replicate=8, tp=8, first_rank=64))):
        t0 = time.perf_counter()
        plan = offline_plan(model, src, dst, src_dtype="F32", dst_dtype="BF16", ranks_per_node=8)
        seconds = time.perf_counter() - t0
        links = by_link(plan)
        sent, got = rank_loads(plan)
        text = str(plan)
        print(f"--- dp_shard=8 x tp=8 -> tp=8 x 8 replicas on {where} ---\n{text}\n")
        summaries.append(text)
        rows.append({"destination": f"tp=8 x 8 replicas, {where}", "dst_tb": plan.dst_bytes / 1e12,
                     "local_tb": links["local"] / 1e12, "intra_tb": links["intra-node"] / 1e12,
                     "inter_tb": links["inter-node"] / 1e12, "max_sent_gb": max(sent.values()) / 1e9,
                     "max_recv_gb": max(got.values()) / 1e9, "buckets": len(plan.buckets),
                     "plan_s": seconds})
    notes = (f"A DeepSeek-V3-shaped model ({params / 1e9:.0f}B parameters, experts stacked), planned offline "
             "from degrees (`shardwise.transfer.offline_plan`, nothing allocated): float32 under FSDP2 x TP "
             "(dp_shard=8 x tp=8, 64 ranks, 8 per node) into bfloat16 at tp=8 x 8 replicas, 256 MiB buckets "
             "(each rank's send + receive). TB are 10**12 bytes per weight sync; `plan s`: computing the "
             "plan on this machine. Command: `python3 benchmarks/transfer_671b.py`.")
    cols = [("destination", "destination"), ("dst_tb", "destination TB", ".3f"),
            ("local_tb", "copied locally TB", ".3f"), ("intra_tb", "intra-node TB", ".3f"),
            ("inter_tb", "inter-node TB", ".3f"), ("max_sent_gb", "max sent per rank GB", ".1f"),
            ("max_recv_gb", "max received per rank GB", ".1f"), ("buckets", "buckets"),
            ("plan_s", "plan s", ".1f")]
    print(write_results("transfer-671b", rows, cols, notes, extra={"summaries": summaries}))
    info = machine_info()
    if not info["commit"].endswith("-dirty"):
        blocks = "\n\n".join(f"### Destination: {r['destination']}\n\n```text\n{t}\n```"
                               for r, t in zip(rows, summaries, strict=True))
        (REPO / "docs" / "transfer-671b.md").write_text(
            "# A 671B weight sync, planned offline\n\n" + notes + "\n\n" + blocks
            + f"\n\n_Written by benchmarks/transfer_671b.py at commit {info['commit']}._\n")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    main()
