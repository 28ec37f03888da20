"""The import direction of docs/architecture.md, held: every import of one of the package's own
modules (at a module's top, deferred into a function, or as a string path such as
``"shardwise.io.load:load"``) goes to its own layer or one below; no two modules import each
other, however indirectly; a string path to our own modules only in the three registries; at
most six imports deferred into functions, each with its reason in a comment."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import shardwise as sw

SRC = Path(sw.__file__).parent

# bottom to top, as docs/architecture.md draws them; a module is in the first layer one of whose
# prefixes it starts with (a prefix names a module or a package)
LAYERS = [
    ("core", ["errors", "_version", "_progress", "core"]),
    ("runtime", ["backends", "comm", "mesh", "holding", "local_tp", "plan_checks", "quant", "parallel"]),
    ("storage", ["io.storage"]),
    ("read floor", ["io.read", "io.source", "io.sink", "io.info", "io.staging", "io.placed", "io.dist_save"]),
    ("formats", ["io.formats"]),
    ("adapters", ["adapters"]),
    ("pipelines", ["io.load", "io.save", "io.consolidate", "io.check", "io.gather", "io.place",
                   "io.parallel_write", "io.guards", "io", "transfer"]),
    ("tools", ["hf", "validate", "testing", "plan_probe", "plan_report"]),
    ("front", ["cli", "plan_cli", "demo", "__main__", ""]),
]
# may hold string paths; core.adapter loads the model adapters shardwise ships (hf.adapter) on its
# first use, so that `import shardwise` imports no torch
REGISTRIES = {"shardwise", "shardwise.backends", "shardwise.io.formats", "shardwise.core.adapter"}
_STRING = re.compile(r"(shardwise(?:\.\w+)+)(?::\w+)?")


def _name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(SRC.rglob("*.py"))}


def layer(module: str) -> int:
    rel = module[len("shardwise."):] if module != "shardwise" else ""
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(rel == p or (p and rel.startswith(p + ".")) for p in prefixes):
            return rank
    raise AssertionError(f"{module} is in no layer of docs/architecture.md; add it there and here")


def imports(module: str) -> list[tuple[str, str, int]]:
    """``(target module, "top" | "deferred" | "string", line)`` of every import of our own modules
    in ``module``, but those under ``if TYPE_CHECKING:`` (never run)."""
    tree = ast.parse(MODULES[module].read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for b in node.body for n in ast.walk(b)}
    inner = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(fn)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
            targets, kind = subs or [node.module], "deferred" if id(node) in inner else "top"
        elif isinstance(node, ast.Import):
            targets, kind = [a.name for a in node.names], "deferred" if id(node) in inner else "top"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _STRING.fullmatch(node.value):
            targets, kind = [_STRING.fullmatch(node.value).group(1)], "string"
        else:
            continue
        for t in targets:
            while kind != "string" and t not in MODULES and "." in t:
                t = t.rsplit(".", 1)[0]  # `from pkg.mod import name`
            if t in MODULES and t != module:
                found.append((t, kind, node.lineno))
    return found


GRAPH = {m: imports(m) for m in MODULES}


def _own_package(module: str, target: str) -> bool:
    # a package loading its own children (a registry, a plugin's entry) is its namespace, not a
    # dependency; the children importing their package's shared types is
    return target.startswith(module + ".")


def test_every_module_sits_in_a_layer_and_imports_only_its_own_or_lower_ones():
    upward = sorted(f"{m}:{line} ({kind}) -> {t}" for m, found in GRAPH.items() for t, kind, line in found
                    if layer(t) > layer(m) and not _own_package(m, t)
                    and not (kind == "string" and m in REGISTRIES)  # a plugin registering itself
                    and not (t == "shardwise" and LAYERS[layer(m)][0] == "tools"))  # the public API
    assert upward == []


def test_no_import_cycle_counting_deferred_and_string_imports():
    # a registry's string path names a plugin that registers itself into it (hf.adapter imports
    # core.adapter to call register_adapter): a lookup on first use, not a dependency of the
    # registry's module; every other string path counts
    edges = {m: {t for t, kind, _ in found if not _own_package(m, t)
                 and not (kind == "string" and m in REGISTRIES)} for m, found in GRAPH.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert cycles == []


def test_string_paths_to_our_modules_live_in_the_registries_only():
    found = sorted(f"{m} -> {t}" for m, f in GRAPH.items() for t, kind, _ in f
                   if kind == "string" and m not in REGISTRIES)
    assert found == []


def test_at_most_six_deferred_imports_each_with_its_reason():
    # the lazy doors (the package's public names, cli, demo) defer on purpose: start-up time;
    # plan_cli, a front module too, is counted (cli imports it when its command runs)
    doors = {"shardwise", "shardwise.cli", "shardwise.demo", "shardwise.__main__"}
    deferred = [(m, t, line) for m, f in GRAPH.items() if m not in doors for t, kind, line in f
                if kind == "deferred"]
    assert len(deferred) <= 6, deferred
    for m, t, line in deferred:
        lines = MODULES[m].read_text().splitlines()
        nearby = " ".join(lines[max(0, line - 8):line]).lower()
        assert "deferred" in nearby, f"{m}:{line} defers importing {t} without saying why"


def test_the_scanner_sees_every_kind_of_import():
    # the package's own modules: a string path (a registry), a deferred import, a top import
    kinds = {k for found in GRAPH.values() for _, k, _ in found}
    assert kinds == {"top", "deferred", "string"}
    assert ("shardwise.io.load", "string") in {(t, k) for t, k, _ in GRAPH["shardwise"]}
