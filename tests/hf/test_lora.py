"""sw.load_adapter / sw.save_adapter with real PEFT LoRA adapters on spawned gloo ranks: logits equal
the one-process PeftModel's, two adapters switched and combined, merge / unmerge on the shards (bit
for bit back), the adapter saved back byte for byte, each rank reading only its slices, bad input
refused with the model as it was, and sw.save of a model with adapters writing its base."""

from __future__ import annotations

import functools
import json
import shutil

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

import torch  # noqa: E402
from lora_models import logits, lora_layers, make, model_class, switched  # noqa: E402
from safetensors import safe_open  # noqa: E402

import shardwise as sw  # noqa: E402
from harness import run_ranks  # noqa: E402
from shardwise.errors import CheckpointError  # noqa: E402
from shardwise.holding import local_of  # noqa: E402

TOLERANCE = 1e-5
SHARDED_A = ("o_proj", "down_proj", "embed_tokens")  # rowwise / vocab-parallel bases: lora_A split


def _rchar() -> int:
    """Bytes this process read through read system calls (pread included)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _attach(kind: str, folder: str, holding: str | None) -> dict:
    from peft.functional import delete_adapter, set_adapter  # imported before the bytes are counted

    backend = sw.init_backend("gloo")
    model = sw.from_pretrained(model_class(kind), f"{folder}/ckpt", mesh=backend.mesh(tp=backend.world_size),
                               holding=holding)
    base = [(n, p, local_of(p).detach().clone()) for n, p in model.named_parameters()]
    sw.load_adapter(model, f"{folder}/a", adapter_name="a")
    before = _rchar()
    result = sw.load_adapter(model, f"{folder}/b", adapter_name="b")
    read = _rchar() - before
    out = {"a": logits(model).tolist(), "read": read, "bytes_read": result.bytes_read,
           # PEFT's set_adapter for models it did not wrap (transformers' own needs peft >= 0.22)
           **switched(model, lambda m: logits(m).tolist(), functools.partial(set_adapter, model))}
    out["merge_changed"] = sum(not torch.equal(local_of(p), kept) for _, p, kept in base)
    for layer in lora_layers(model):
        layer.unmerge()
    out["unmerge_differs"] = [n for n, p, kept in base if not torch.equal(local_of(p), kept)]
    for layer in lora_layers(model):
        layer.enable_adapters(False)
    out["disabled"] = logits(model).tolist()
    for layer in lora_layers(model):
        layer.enable_adapters(True)
    sw.save_adapter(model, f"{folder}/saved_a", adapter_name="a")
    delete_adapter(model, "b", prefix="lora_")
    out["deleted"] = logits(model).tolist()
    return out


def _expected_slices(path: str, tp: int) -> int:
    """Bytes of the adapter at ``path`` a rank holds: its slice of each split LoRA tensor, others whole."""
    total = 0
    with safe_open(path, "pt") as f:
        for key in f.keys():
            t = f.get_slice(key)
            nbytes = t.get_shape()[0] * t.get_shape()[1] * 4
            split = ("_A" in key) == any(f".{m}." in key for m in SHARDED_A)
            total += nbytes // tp if split else nbytes
    return total


def _metadata_bytes(folder) -> int:
    weights = folder / "adapter_model.safetensors"
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    return header + (folder / "adapter_config.json").stat().st_size


@pytest.mark.parametrize("kind,tp,holding", [("llama", 2, None), ("llama", 4, None), ("phi3", 2, None),
                                             ("phi3", 4, None), ("qwen3", 2, None), ("qwen3", 4, None),
                                             ("llama", 2, "local")])
def test_lora_on_shards_equals_one_process_peft(tmp_path, kind, tp, holding):
    reference = make(kind, tmp_path)
    rows = run_ranks(_attach, tp, kind, str(tmp_path), holding, timeout=240)
    slices = _expected_slices(str(tmp_path / "b" / "adapter_model.safetensors"), tp)
    for rank, row in enumerate(rows):
        for what in ("a", "b", "ab"):
            diff = (torch.tensor(row[what]) - reference[what]).abs().max().item()
            assert diff <= TOLERANCE, (kind, tp, rank, what, diff)
        assert (torch.tensor(row["merged"]) - reference["merged"]).abs().max().item() <= TOLERANCE
        assert (torch.tensor(row["disabled"]) - reference["base"]).abs().max().item() <= TOLERANCE
        assert (torch.tensor(row["deleted"]) - reference["a"]).abs().max().item() <= TOLERANCE
        assert row["merge_changed"] > 0 and row["unmerge_differs"] == []
        assert row["bytes_read"] == slices, (rank, row["bytes_read"], slices)
        assert row["read"] <= 1.05 * slices + _metadata_bytes(tmp_path / "b"), (rank, row["read"], slices)
    # save_adapter wrote PEFT's weights file byte for byte, and its config (PEFT writes target_modules,
    # a set, in the process's hash order: compared as sets)
    name = "adapter_model.safetensors"
    assert (tmp_path / "saved_a" / name).read_bytes() == (tmp_path / "a" / name).read_bytes()
    configs = [json.loads((tmp_path / f / "adapter_config.json").read_text()) for f in ("a", "saved_a")]
    for config in configs:
        config["target_modules"] = sorted(config["target_modules"])
    assert configs[0] == configs[1]


def _refuse(kind: str, folder: str) -> dict:
    backend = sw.init_backend("gloo")
    model = sw.from_pretrained(model_class(kind), f"{folder}/ckpt", mesh=backend.mesh(tp=backend.world_size))
    sw.load_adapter(model, f"{folder}/a", adapter_name="a")
    def structure():
        return [type(m).__name__ for m in model.modules()], [n for n, _ in model.named_parameters()]

    shape = structure()
    first = logits(model)
    errors = {}
    for bad in ("missing_module", "fewer_modules", "wrong_rank", "dora", "same_name"):
        try:
            sw.load_adapter(model, f"{folder}/{bad}", adapter_name="a" if bad == "same_name" else "bad")
        except (CheckpointError, sw.UsageError) as e:
            errors[bad] = str(e)
        assert structure() == shape
        assert sorted(model.peft_config) == ["a"]
        assert torch.equal(logits(model), first), bad
    return errors


def test_bad_adapters_are_refused_and_leave_the_model_as_it_was(tmp_path):
    make("llama", tmp_path)
    for bad, change in (("missing_module", {"target_modules": ["no_such_proj"]}),
                        ("fewer_modules", {"target_modules": ["q_proj"]}),
                        ("wrong_rank", {"r": 5}), ("dora", {"use_dora": True}), ("same_name", {})):
        shutil.copytree(tmp_path / "a", tmp_path / bad)
        config = json.loads((tmp_path / bad / "adapter_config.json").read_text())
        (tmp_path / bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
    errors = run_ranks(_refuse, 2, "llama", str(tmp_path), timeout=240)[0]
    assert "no_such_proj" in errors["missing_module"]
    assert "unexpected ['base_model.model.lm_head.lora_A.weight'" in errors["fewer_modules"]
    assert "has shape (4, " in errors["wrong_rank"] and "needs (5, " in errors["wrong_rank"]
    assert "DoRA" in errors["dora"]
    assert "attached already" in errors["same_name"]


def _save_base(folder: str) -> None:
    backend = sw.init_backend("gloo")
    model = sw.from_pretrained(model_class("llama"), f"{folder}/ckpt", mesh=backend.mesh(tp=2))
    sw.load_adapter(model, f"{folder}/a", adapter_name="a")
    sw.save(model, f"{folder}/base", max_shard_size="60KB")
    for layer in lora_layers(model):
        layer.merge()
    sw.save(model, f"{folder}/merged", max_shard_size="60KB")


def test_save_of_a_model_with_adapters_writes_its_base_or_the_merged_base(tmp_path):
    reference = make("llama", tmp_path)
    run_ranks(_save_base, 2, str(tmp_path), timeout=240)
    for f in sorted((tmp_path / "ckpt").iterdir()):
        assert (tmp_path / "base" / f.name).read_bytes() == f.read_bytes(), f.name
    merged = model_class("llama").from_pretrained(tmp_path / "merged").eval()
    assert (logits(merged) - reference["a"]).abs().max().item() <= TOLERANCE
