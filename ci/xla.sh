#!/usr/bin/env bash
# CI job "xla": the torch_xla suite on PJRT: one device, SPMD over 4 devices, and
# `shardwise validate --backend xla_spmd` over 4 and 8 devices (PJRT_DEVICE=CPU on a CPU runner;
# TPU on a TPU VM). Runner: a CPU machine, or a TPU VM with PJRT_DEVICE=TPU.
# Extra arguments go to pytest (e.g. ci/xla.sh -x -k load).
#
# The env is large: torch-xla 2.9.0 runs only beside torch 2.9.0, and PyPI's torch 2.9.0 is a
# CUDA build. Installed it takes about 7.1 GB, and pip holds about 3 GB of downloaded wheels
# beside it while it installs. A runner without that much free disk cannot build the env; the
# job then says so and does not run rather than dying half-way through pip with ENOSPC.
# SHARDWISE_XLA_REQUIRE=1 makes that a failure (for a runner that must run this suite).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q 'tox>=4'
export PIP_NO_CACHE_DIR=1  # a cache would keep a second 3 GB copy of the wheels
need_gb=11
if ! .tox/xla/bin/python -c "import torch_xla" 2>/dev/null; then
  free_gb() { df -Pk "$1" | awk 'NR==2 {print int($4 / 1048576)}'; }
  here=$(free_gb .)
  tmp=$(free_gb "${TMPDIR:-/tmp}")
  if [ "$here" -lt "$need_gb" ] || [ "$tmp" -lt 4 ]; then
    echo "xla: NOT RUN: building its env needs about ${need_gb} GB free here and 4 GB in ${TMPDIR:-/tmp};" \
         "there are ${here} GB and ${tmp} GB. Free disk space, or run ci/xla.sh on a larger runner." >&2
    if [ "${SHARDWISE_XLA_REQUIRE:-0}" = 1 ]; then exit 1; fi
    exit 0
  fi
fi
if [ "$#" -gt 0 ]; then exec tox -e xla -- "$@"; else exec tox -e xla; fi  # no "--": keep the env's default args
