"""The plans transformers and diffusers ship claim the same modules and find the same head counts
through the trie and the parent walk as through the scans they replaced (tests/plan_reference.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from hf_models import KINDS, model_class  # noqa: E402

from plan_reference import reference_head_counts, reference_match_plan  # noqa: E402
from shardwise.core.adapter import adapter_for  # noqa: E402
from shardwise.core.plan import resolve_plan  # noqa: E402
from shardwise.core.plan_rules import head_counts  # noqa: E402
from shardwise.core.styles import match_plan  # noqa: E402


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_shipped_plans_match_as_before(kind):
    library, _, config = KINDS[kind]
    cls = model_class(kind)
    with torch.device("meta"):
        model = cls._from_config(config()) if library == "transformers" else cls.from_config(config())
    checked = 0
    for axis in ("tp", "ep"):
        plan = adapter_for(model).shipped_plan(model, axis)
        if plan:
            assert match_plan(model, plan) == reference_match_plan(model, plan)
            checked += 1
    assert checked, f"{kind} ships no plan"
    specs = resolve_plan(model, "auto", 1)
    sharded = [p for p, s in specs.styles.items() if s.sharded] + list(specs.local_owners)
    assert head_counts(model, sharded) == reference_head_counts(model, sharded)
