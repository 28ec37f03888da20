"""The package's ``>>>`` examples run: every module's docstrings, through ``doctest``, in the
gloo environment. An example that needs ranks, a device or a checkpoint says ``+SKIP``; every
other one must print what it shows. A module that cannot be imported here may only lack one of
the optional packages (object stores, model libraries, accelerators)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import torch

import shardwise as sw

SRC = Path(sw.__file__).parent
OPTIONAL = {"obstore", "fsspec", "aiohttp", "huggingface_hub", "transformers", "diffusers", "peft",
            "accelerate", "torch_xla", "torch_neuronx"}


def _modules() -> list[str]:
    names = []
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_the_package_examples_print_what_they_show():
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    unimportable = {}
    for name in _modules():
        if name.endswith("__main__"):
            continue  # runs its command line on import
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            unimportable[name] = e.name
            continue
        for test in finder.find(module, name, globs={"sw": sw, "torch": torch, **vars(module)}):
            runner.run(test)
    assert all(str(missing).split(".")[0] in OPTIONAL for missing in unimportable.values()), unimportable
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} example(s) failed; the report above names them"
    assert results.attempted >= 60, results  # the examples were found (69 lines run here)
