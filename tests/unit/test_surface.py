"""The public surface is ``shardwise.__all__`` and nothing else: the names DESIGN.md shows, the
base error and the ones callers catch most (every error is in ``shardwise.errors``), and the
README and docs/ use only those."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import shardwise as sw

ROOT = Path(__file__).resolve().parents[2]

PUBLIC = {
    "__version__",
    "Backend", "init_backend", "shutdown_backend", "parallelize", "clip_grad_norm_",
    "ShardSpec", "PackedColwise", "PackedRowwise",
    "load", "save", "consolidate", "save_optimizer", "load_optimizer", "from_pretrained",
    "empty_model", "inspect", "verify", "diff", "validate",
    "ShardwiseError", "CheckpointError", "CollectiveError", "PlanError", "UsageError",
    "transfer_plan", "check_plan",
    "load_adapter", "save_adapter",
}
# served here before, now only in their own modules (tests and internals import them there)
REMOVED = [
    "resolve_plan", "current_backend", "available_backends", "register_backend", "get_shard_state",
    "Region", "LoadResult", "inspect_checkpoint", "BackendError", "BackendUnavailableError",
    "MeshError", "NonFiniteError", "ShardingError", "StorageError", "UnknownBackendError",
    "UnsupportedModelError", "TransferError",
]


def test_all_is_the_public_set():
    assert set(sw.__all__) == PUBLIC
    # DESIGN.md: + check_plan, load_adapter, save_adapter
    assert len(sw.__all__) == len(set(sw.__all__)) <= 29


@pytest.mark.parametrize("name", sorted(PUBLIC - {"__version__"}))
def test_each_public_name_resolves_to_what_it_says(name):
    value = getattr(sw, name)
    assert callable(value), name  # a function or a class; sw.validate is the callable package
    if name.endswith("Error"):
        assert issubclass(value, sw.ShardwiseError) and value is getattr(sw.errors, name)
    elif isinstance(value, types.ModuleType):
        assert name == "validate"


@pytest.mark.parametrize("name", REMOVED)
def test_removed_names_are_gone_from_the_top(name):
    with pytest.raises(AttributeError, match=name):
        getattr(sw, name)


def test_dir_serves_exactly_all_and_the_errors_namespace():
    assert set(dir(sw)) == set(sw.__all__) | {"errors"}
    assert set(sw.__all__) <= {n for n in dir(sw) if hasattr(sw, n)}


def test_every_error_is_in_the_errors_namespace():
    errors = {n: v for n, v in vars(sw.errors).items() if isinstance(v, type) and issubclass(v, Exception)}
    assert "ShardingError" in errors and "StorageError" in errors
    assert all(issubclass(v, sw.ShardwiseError) for v in errors.values())
    assert {n for n in sw.__all__ if n.endswith("Error")} <= set(errors)


def test_testing_is_imported_on_use_only():
    code = "import sys, shardwise; print('shardwise.testing' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_and_docs_use_only_public_names():
    allowed = set(sw.__all__) | {"errors"}
    used = {(p.name, m) for p in _docs() for m in re.findall(r"\bsw\.(\w+)", p.read_text())}
    assert used, "the scan found no sw.X at all"
    assert {(f, n) for f, n in used if n not in allowed} == set()
    errors = {(p.name, m) for p in _docs() for m in re.findall(r"\bsw\.errors\.(\w+)", p.read_text())}
    assert {(f, n) for f, n in errors if not hasattr(sw.errors, n)} == set()


def test_docs_code_imports_only_public_modules():
    # the adapter seam (ModelAdapter, register_adapter) is a plugin author's API, documented
    # in docs/guide.md; everything a user calls is in shardwise, errors or testing
    public = {"shardwise", "shardwise.errors", "shardwise.testing", "shardwise.core.adapter"}
    found = set()
    for p in _docs():
        for block in re.findall(r"```python\n(.*?)```", p.read_text(), re.S):
            for mod in re.findall(r"^\s*(?:from|import) (shardwise[\w.]*)", block, re.M):
                found.add((p.name, mod))
    assert found, "the scan found no import at all"
    assert {(f, m) for f, m in found if m not in public} == set()


def _shardwise_imports(tree) -> list[tuple[int, str, bool]]:
    """``(line, module, inside an except ModuleNotFoundError)`` of every shardwise import."""
    fallback: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler) and isinstance(node.type, ast.Name) \
                and node.type.id == "ModuleNotFoundError":
            fallback |= {id(n) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"shardwise.{a.name}" for a in node.names] if node.module == "shardwise" else []
            mods = [node.module, *subs]
        else:
            continue
        out += [(node.lineno, m, id(node) in fallback) for m in mods if m.split(".")[0] == "shardwise"]
    return out


def test_benchmarks_import_only_shardwise_and_shardwise_testing():
    # shardwise.transfer is the transfer verb's public package (its offline plan from degrees)
    # shardwise.testing.cluster is the test kit's simulated cluster (benchmarks/cluster.py runs on it)
    public = {"shardwise", "shardwise.testing", "shardwise.errors", "shardwise.transfer",
              "shardwise.testing.cluster"}
    found = {}
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for line, mod, fallback in _shardwise_imports(ast.parse(path.read_text())):
            # a fallback for a --base commit from before shardwise.testing is the only exception
            if mod not in public and not fallback:
                found[f"{path.name}:{line}"] = mod
    assert found == {}
    # the scanner itself: it sees a private import and a fallback
    probe = ast.parse("from shardwise.io import x\ntry:\n    pass\nexcept ModuleNotFoundError:\n"
                      "    from shardwise.launch import spawn\n")
    assert sorted(_shardwise_imports(probe)) == [(1, "shardwise.io", False), (5, "shardwise.launch", True)]
