#!/usr/bin/env bash
# CI job "lint": ruff over src, tests and benchmarks, and mypy over the package (it ships
# py.typed; the settings are [tool.mypy] in pyproject.toml). Runner: any CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q 'tox>=4'
exec tox -e lint
