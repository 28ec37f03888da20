#!/usr/bin/env bash
# CI job "nccl": the CUDA/NCCL hardware suite, one rank per visible GPU. Runner: a machine with one or more NVIDIA GPUs and a CUDA build of torch.
# Extra arguments go to pytest (e.g. ci/nccl.sh -x -k load).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q 'tox>=4'
if [ "$#" -gt 0 ]; then exec tox -e nccl -- "$@"; else exec tox -e nccl; fi  # no "--": keep the env's default args
