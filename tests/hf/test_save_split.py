"""sw.save splits files where huggingface_hub's split_torch_state_dict_into_shards (so
save_pretrained) does, and names them alike."""

import pytest

pytest.importorskip("huggingface_hub")

import torch  # noqa: E402
from huggingface_hub import split_torch_state_dict_into_shards  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from shardwise.io.formats.safetensors.files import plan_files  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12), limit=st.integers(1, 400))
def test_split_matches_the_hub(sizes, limit):
    names = [f"t{i}" for i in range(len(sizes))]
    state = {n: torch.empty(s, dtype=torch.uint8) for n, s in zip(names, sizes, strict=True)}
    hub = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                             max_shard_size=limit)
    ours = plan_files([(n, "U8", (s,)) for n, s in zip(names, sizes, strict=True)], limit, "model")
    assert {f: [s[0] for s in group] for f, group in ours} == hub.filename_to_tensors
    assert [f for f, _ in ours] == list(hub.filename_to_tensors)
