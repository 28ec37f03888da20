"""The torch range and the pins CI tests with stay consistent (ci/README.md): the torch_floor env
installs exactly pyproject's lowest torch, torch_newest one above it, ci/constraints.txt pins
no torch (each env pins its own) and pins every Hugging Face library the hf env installs, and
only the `latest` env goes without the pins."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _tox() -> configparser.ConfigParser:
    ini = configparser.ConfigParser(interpolation=None)
    ini.read(ROOT / "tox.ini")
    return ini


def _torch_pin(env: str) -> Version:
    deps = _tox()[f"testenv:{env}"]["deps"]
    return Version(re.search(r"^\s*torch==([\w.]+)\s*$", deps, re.M).group(1))


def _pyproject_floor() -> Version:
    text = (ROOT / "pyproject.toml").read_text()
    spec = Requirement(re.search(r'^\s*"(torch>=[^"]+)"', text, re.M).group(1)).specifier
    return Version(next(s.version for s in spec if s.operator == ">="))


def _pins() -> dict[str, str]:
    lines = (ROOT / "ci" / "constraints.txt").read_text().splitlines()
    return dict(re.match(r"^([\w.\-]+)==(\S+)", ln).groups() for ln in lines if re.match(r"^[\w.\-]+==", ln))


def test_the_floor_env_runs_pyprojects_lowest_torch_and_newest_runs_a_later_one():
    assert _torch_pin("torch_floor") == _pyproject_floor()
    assert _torch_pin("torch_newest") > _pyproject_floor()


def test_constraints_pin_the_hf_libraries_and_no_torch():
    pins = {k.lower().replace("_", "-"): v for k, v in _pins().items()}
    assert "torch" not in pins
    for name in ("transformers", "diffusers", "accelerate", "peft", "huggingface-hub", "safetensors"):
        assert name in pins, name


def test_every_env_that_installs_libraries_reads_the_pins_but_latest():
    ini = _tox()
    for env in ("gloo", "stress", "hf", "remote", "zoo", "bench", "lint", "torch_floor", "torch_newest"):
        assert "PIP_CONSTRAINT = {tox_root}/ci/constraints.txt" in ini[f"testenv:{env}"]["set_env"], env
    assert "PIP_CONSTRAINT" not in ini["testenv:latest"].get("set_env", "")
