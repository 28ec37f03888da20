#!/usr/bin/env bash
# CI job "torch": the hardware-free suites (tests/unit, tests/dist: real spawned gloo ranks) on
# the ends of the torch range pyproject.toml admits: `ci/torch.sh floor` (tox env torch_floor:
# the lowest torch, 2.9.0) and `ci/torch.sh newest` (tox env torch_newest: the newest pip installs
# here, 2.14.1). Both are PyPI CUDA builds of several GB that run on CPU. Runner: any Linux CPU
# machine with about 12 GB free. Extra arguments replace the test paths and go to pytest
# (e.g. ci/torch.sh floor tests/unit -x -k load).
set -euo pipefail
cd "$(dirname "$0")/.."
which=${1:?usage: ci/torch.sh floor|newest [pytest args]}
shift
case "$which" in floor|newest) ;; *) echo "ci/torch.sh: floor or newest, not '$which'" >&2; exit 2;; esac
python3 -m pip install -q 'tox>=4'
export PIP_NO_CACHE_DIR=1  # a cache would keep a second copy of the CUDA build's wheels
if [ "$#" -gt 0 ]; then exec tox -e "torch_$which" -- "$@"; else exec tox -e "torch_$which"; fi
