"""``sw.verify(path, against=MODEL)`` / ``shardwise verify PATH --against MODEL``: every tensor's
name and shape (and dtype, where defined) against what the model's class and config expect.

A checkpoint whose headers and checksums agree with each other but which holds a tensor of
the wrong shape (issue 20: a fused ``gqkv_proj.weight`` written as (64, 64), one of its four
parts, instead of (256, 64)) passes plain ``verify``; ``--against`` reports it. HrmText keeps
``gate_proj``/``q_proj``/``k_proj``/``v_proj`` apart in its modules and stores them as one
``attn.gqkv_proj.weight`` (transformers' ``Chunk`` conversion), Llama stores its module names,
Qwen3 (tied) stores its embedding once, Flux2 is a diffusers model.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import shardwise as sw  # noqa: E402
from hf import hf_models  # noqa: E402
from shardwise.cli import main  # noqa: E402
from shardwise.io.check.against import expected_tensors  # noqa: E402

FUSED = "model.H_module.layers.0.attn.gqkv_proj.weight"


def _hrm_config():
    from transformers import HrmTextConfig

    return HrmTextConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=False)


def _hrm(seed: int = 0):
    from transformers import HrmTextForCausalLM

    model = HrmTextForCausalLM._from_config(_hrm_config())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module")
def hrm(tmp_path_factory):
    """HrmText written by ``save_pretrained``: one file, and several with an index."""
    root = tmp_path_factory.mktemp("hrm")
    model = _hrm()
    model.save_pretrained(root / "one")
    model.save_pretrained(root / "sharded", max_shard_size="60KB")
    return root


def _rewrite(folder, key, change):
    """Rewrite the file holding ``key`` with ``change(tensor)`` in its place, as a valid
    safetensors file (its header and data agree: nothing but the model can tell)."""
    index = folder / "model.safetensors.index.json"
    name = json.loads(index.read_text())["weight_map"][key] if index.exists() else "model.safetensors"
    tensors = load_file(folder / name)
    changed = change(tensors)
    save_file(changed, folder / name, metadata={"format": "pt"})
    if index.exists():  # the index lists the keys the file now holds
        content = json.loads(index.read_text())
        content["weight_map"] = {k: v for k, v in content["weight_map"].items() if v != name or k in changed}
        content["weight_map"].update(dict.fromkeys(changed, name))
        index.write_text(json.dumps(content))


def test_fused_layout_is_what_save_pretrained_writes(hrm):
    expected = expected_tensors(hrm / "one")
    assert expected[FUSED] == ((256, 64), "F32")
    assert "model.H_module.layers.0.self_attn.q_proj.weight" not in expected
    # the module layout names the model's own tensors, a (64, 64) block each
    module = expected_tensors(hrm / "one", layout="module")
    assert module["model.H_module.layers.0.self_attn.q_proj.weight"] == ((64, 64), "F32")
    assert FUSED not in module
    on_disk = {}
    for f in (hrm / "sharded").glob("*.safetensors"):
        on_disk.update({k: ((tuple(t.shape)), "F32") for k, t in load_file(f).items()})
    assert expected == on_disk


@pytest.mark.parametrize("files", ["one", "sharded"])
def test_save_pretrained_checkpoint_passes(hrm, files):
    for against in (hrm / "one", hrm / "one" / "config.json", _hrm()):
        report = sw.verify(hrm / files, against=against)
        assert report.ok, report.problems
        assert report.against.layout == "hub" and report.against.expected == 19
        assert report.against.dtypes_compared == isinstance(against, torch.nn.Module)
        assert "matches HrmTextForCausalLM" in report.summary()


@pytest.mark.parametrize("files", ["one", "sharded"])
def test_a_fused_tensor_of_the_wrong_shape_is_reported(hrm, tmp_path, files):
    folder = tmp_path / files
    shutil.copytree(hrm / files, folder)
    # the corrupt save of issue 20: the fused key holds one of its four parts
    _rewrite(folder, FUSED, lambda t: {**t, FUSED: t[FUSED][:64].clone()})
    assert sw.verify(folder).ok  # consistent with itself
    report = sw.verify(folder, against=hrm / "one")
    assert not report.ok
    assert report.against.wrong == [f"{FUSED!r} is (64, 64) in the checkpoint, but HrmTextForCausalLM "
                                    f"from {hrm / 'one'} expects (256, 64)"]  # the folder passed
    assert not report.against.missing and not report.against.unexpected
    assert any(FUSED in p and "(256, 64)" in p for p in report.problems)
    assert report.summary().startswith("FAILED")


def test_missing_and_unexpected_tensors(hrm, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(hrm / "one", folder)
    down = "model.L_module.layers.1.mlp.down_proj.weight"
    _rewrite(folder, down, lambda t: {**{k: v for k, v in t.items() if k != down},
                                      "extra.bias": torch.ones(3)})
    report = sw.verify(folder, against=hrm / "one")
    assert not report.ok and report.against.missing == [down] and report.against.unexpected == ["extra.bias"]
    assert any("1 tensor(s) that HrmTextForCausalLM" in p and repr(down) in p for p in report.problems)


def test_dtypes_are_compared_when_given_or_held(hrm):
    report = sw.verify(hrm / "one", against=hrm / "one", dtype="bfloat16")
    assert not report.ok and len(report.against.wrong) == 19
    assert "is F32 (96, 64) in the checkpoint" in report.against.wrong[0]
    assert "expects BF16 (96, 64)" in report.against.wrong[0]
    assert sw.verify(hrm / "one", against=hrm / "one", dtype=torch.float32).ok
    # a model in hand has its dtypes: a bfloat16 one does not match a float32 checkpoint
    report = sw.verify(hrm / "one", against=_hrm().to(torch.bfloat16))
    assert not report.ok and report.against.dtypes_compared and len(report.against.wrong) == 19


def test_module_layout_and_distributed_checkpoints(hrm, tmp_path):
    model = _hrm()
    sw.save(model, tmp_path / "module", layout="module")  # the model's own names
    sw.save(model, tmp_path / "dcp", distributed=True)
    sw.save(model, tmp_path / "rank-local", distributed=True, format="safetensors")
    for folder in ("module", "dcp", "rank-local"):
        report = sw.verify(tmp_path / folder, against=hrm / "one")
        assert report.ok and report.against.layout == "module", (folder, report.problems)
        assert report.against.expected == 35
    sw.save(model, tmp_path / "hub")  # the default layout: what save_pretrained writes
    report = sw.verify(tmp_path / "hub", against=hrm / "one")
    assert report.ok and report.against.layout == "hub" and report.checksummed == 19, report.problems
    # asked for the hub layout, the module names are all wrong
    report = sw.verify(tmp_path / "dcp", against=hrm / "one", layout="hub")
    assert not report.ok and FUSED in report.against.missing
    assert "model.H_module.layers.0.self_attn.q_proj.weight" in report.against.unexpected


@pytest.mark.parametrize("kind", ["llama", "qwen3_tied", "flux2"])
def test_other_families_pass(tmp_path, kind):
    folder = hf_models.save_tiny(kind, tmp_path / kind)
    report = sw.verify(folder, against=folder)
    assert report.ok, report.problems
    assert report.against.expected == report.tensors
    if kind == "qwen3_tied":  # the head is the embedding: stored once
        assert "lm_head.weight" not in expected_tensors(folder)
        report = sw.verify(folder, against=hf_models.build_tiny(kind))
        assert report.ok and report.against.dtypes_compared, report.problems


def test_cli(hrm, tmp_path, capsys):
    one = str(hrm / "one")
    # save_pretrained's folder has no shardwise.json: its names and shapes match, its values
    # have no checksum to be checked against (UNVERIFIED, exit 3)
    assert main(["verify", one, "--against", one]) == 3
    assert "matches HrmTextForCausalLM" in capsys.readouterr().out
    folder = tmp_path / "bad"
    shutil.copytree(hrm / "one", folder)
    _rewrite(folder, FUSED, lambda t: {**t, FUSED: t[FUSED][:64].clone()})
    assert main(["verify", str(folder)]) == 3
    assert capsys.readouterr().out.startswith("UNVERIFIED")
    assert main(["verify", str(folder), "--against", one]) == 1
    out = capsys.readouterr()
    assert out.out.startswith("FAILED") and "expects (256, 64)" in out.err
    assert main(["verify", str(folder), "--against", one + "/config.json", "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["ok"] is False and got["against"]["layout"] == "hub"
    assert len(got["against"]["wrong"]) == 1 and FUSED in got["against"]["wrong"][0]
    assert main(["verify", one, "--against", one, "--dtype", "BF16"]) == 1
    capsys.readouterr()
    assert main(["verify", one, "--against", str(tmp_path / "nowhere")]) == 2
    assert "no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["verify", one, "--dtype", "bfloat16"])  # --dtype alone compares with nothing
