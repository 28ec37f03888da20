"""What each backend's environment installs (backends/<name>/requirements.txt): shardwise's own
dependencies, so that a run that installs the package with ``--no-deps`` (or runs from src/ on
PYTHONPATH, as ci/ and the hardware scripts do) does not fail on the first ``sw.load`` (issue 22:
the xla and nccl files lacked xxhash); and the Neuron packages pinned to the right stack."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "backends").glob("*/requirements.txt"))


def _requirements(path: Path) -> dict[str, Requirement]:
    lines = (re.sub(r"\s+#.*", "", line).strip() for line in path.read_text().splitlines())
    reqs = [Requirement(line) for line in lines if line and not line.startswith(("#", "-"))]
    return {canonicalize_name(r.name): r for r in reqs}


def _package_dependencies() -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [canonicalize_name(Requirement(d).name) for d in project["dependencies"]]


def test_every_backend_has_an_environment():
    names = {p.parent.name for p in FILES}
    assert names >= {"gloo", "nccl", "xla", "neuron", "neuron_xla"}, names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.parent.name)
def test_each_environment_installs_the_package_dependencies(path):
    reqs = _requirements(path)
    # torch comes with torch-neuronx (it pins the torch it was built for)
    provided = {"torch"} if "torch-neuronx" in reqs else set()
    missing = [d for d in _package_dependencies() if d not in reqs and d not in provided]
    assert not missing, f"{path.relative_to(ROOT)} lacks {missing}"


@pytest.mark.parametrize("backend,accepts,refuses", [
    # TorchNeuron: the public releases; never the torch_xla-based line
    ("neuron", ["2.13.3.0", "2.14.3.0"], ["2.9.0.2.13.0", "2.15.0"]),
    # torch_xla-based: its last line, torch 2.9; never TorchNeuron
    ("neuron_xla", ["2.9.0.2.13.0", "2.9.0.2.10.1"], ["2.13.3.0", "2.10.0", "2.8.0.2.9.0"]),
])
def test_neuron_environments_pin_their_torch_neuronx(backend, accepts, refuses):
    spec = _requirements(ROOT / "backends" / backend / "requirements.txt")["torch-neuronx"].specifier
    assert [Version(v) in spec for v in accepts] == [True] * len(accepts), spec
    assert [Version(v) in spec for v in refuses] == [False] * len(refuses), spec
