"""``sw.diff`` across a transformers model's hub layout (``save_pretrained``: one tensor per
expert and projection) and its module names (``sw.save(layout="module")``: fused 3-D expert
parameters): the module tensors are assembled from the stored ones through the conversion
mapping of the model the folder's config.json names, and compared value by value.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import shardwise as sw  # noqa: E402
from hf import hf_models  # noqa: E402


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_diff_maps_hub_names_to_module_names(tmp_path, kind):
    hub = hf_models.save_tiny(kind, tmp_path / "hub")
    model = hf_models.build_tiny(kind)
    module_names = set(model.state_dict())
    sw.save(model, tmp_path / "module", layout="module")
    with torch.no_grad():  # a third copy whose one expert weight is off by a known amount
        name, fused = next((n, p) for n, p in model.named_parameters() if n.endswith("experts.down_proj"))
        fused[1, 2, 3] += 0.5
    sw.save(model, tmp_path / "changed", layout="module")

    report = sw.diff(hub, tmp_path / "module")
    assert report.identical, report.summary()
    assert report.same == len(module_names)

    report = sw.diff(tmp_path / "changed", hub)  # the hub side on the right: mapped as well
    assert [d.name for d in report.differ] == [name]
    assert report.differ[0].max_abs_diff == pytest.approx(0.5, abs=1e-6)
    assert not report.only_a and not report.only_b


def test_diff_names_a_stored_expert_that_is_missing(tmp_path):
    hub = hf_models.save_tiny("mixtral", tmp_path / "hub")
    sw.save(hf_models.build_tiny("mixtral"), tmp_path / "module", layout="module")
    for file in hub.glob("*.safetensors"):  # drop one expert's stored tensor
        tensors = load_file(file)
        gone = [k for k in tensors if ".experts.1.w2." in k and ".layers.0." in k]
        if gone:
            del tensors[gone[0]]
            save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(sw.CheckpointError, match="experts"):
        sw.diff(hub, tmp_path / "module")
