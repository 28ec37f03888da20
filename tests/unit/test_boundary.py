"""Decode once, at the door (STYLE.md 16): the process-global backend and the tp axis of a mesh
are read at the API boundary and passed down. ``shardwise.mesh`` decodes a mesh
(``decode_mesh``) or resolves the backend of the collectives (``world_backend``), a public entry
point calls one of them, and nothing below looks either up again."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import shardwise as sw

SRC = Path(sw.__file__).parent


def _calls(name: str) -> set[tuple[str, str]]:
    """``{(module path, enclosing function)}`` of every call of a function named ``name`` in the
    package, however it is reached (``f()``, ``module.f()``); "<module>" outside a function."""
    found = set()
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(SRC).as_posix()
        outer: dict[int, str] = {}
        for fn in ast.walk(tree):  # breadth first: an outer function claims its nodes first
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in ast.walk(fn):
                    outer.setdefault(id(n), fn.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if called == name:
                    found.add((where, outer.get(id(node), "<module>")))
    return found


def test_the_calls_are_found_wherever_they_are():
    # the scanner itself: a call of comm.rank() sits in many functions of many modules
    assert {("comm.py", "gather_object"), ("io/sink.py", "on_rank0")} <= _calls("rank")


@pytest.mark.parametrize("name, boundary", [
    ("current_backend", {("mesh.py", "decode_mesh"), ("mesh.py", "world_backend")}),
    ("tp_axis", {("mesh.py", "decode_mesh")}),
])
def test_only_the_boundary_reads_the_backend_and_the_tp_axis(name, boundary):
    assert _calls(name) == boundary


def test_the_backend_of_the_collectives_is_resolved_by_public_entry_points_only():
    callers = _calls("world_backend")
    assert callers, "nothing resolves the backend: sw.save would run its collectives on none"
    # the public entries, decode_mesh, which they call to decode their mesh at the boundary, and
    # save_pipeline, sw.save's door for a diffusers pipeline (reached through save_collection)
    assert {fn for _, fn in callers} <= {*sw.__all__, "decode_mesh", "save_pipeline"}, callers


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_a_format_imports_no_pipeline_and_no_model_library():
    # a format is a reader/writer pair over a storage: the pipelines call it, never the reverse
    banned = ("shardwise.io.load", "shardwise.io.save", "shardwise.io.pipeline", "shardwise.parallel",
              "shardwise.hf")
    found = {(p.relative_to(SRC).as_posix(), m) for p in sorted((SRC / "io" / "formats").rglob("*.py"))
             for m in _imports(p) if m.startswith(banned)}
    assert found == set()


def test_only_the_storage_touches_bytes():
    # validate/ writes its own report (not a checkpoint); everything else goes through io/storage
    calls = {"pread", "pwrite", "preadv", "pwritev", "replace", "rename", "mmap", "fsync"}
    found = set()
    for path in sorted(SRC.rglob("*.py")):
        where = path.relative_to(SRC).as_posix()
        if where.startswith(("io/storage/", "validate/")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), where)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in ("os", "mmap") \
                    and node.func.attr in calls:
                found.add((where, f"{node.func.value.id}.{node.func.attr}"))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
                found.add((where, "open"))
    # not checkpoint bytes: torchrun's error file, /proc for the memory figures, and the logs of
    # the simulated cluster's processes
    assert found == {("backends/__init__.py", "open"), ("testing/__init__.py", "open"),
                     ("testing/cluster.py", "open")}


def test_only_hf_names_the_config_file():
    # Hugging Face knowledge stays in hf/: a path built from "config.json" is the adapter's
    found = {path.relative_to(SRC).as_posix() for path in sorted(SRC.rglob("*.py"))
             if not path.relative_to(SRC).as_posix().startswith("hf/")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and node.value == "config.json"}
    assert found == set()
