#!/usr/bin/env bash
# CI job "xla": the torch_xla suite on PJRT: one device and SPMD over 4 devices (PJRT_DEVICE=CPU on a CPU runner; TPU on a TPU VM). Runner: a CPU machine, or a TPU VM with PJRT_DEVICE=TPU.
# Extra arguments go to pytest (e.g. ci/xla.sh -x -k load).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q 'tox>=4'
if [ "$#" -gt 0 ]; then exec tox -e xla -- "$@"; else exec tox -e xla; fi  # no "--": keep the env's default args
