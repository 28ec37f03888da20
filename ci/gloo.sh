#!/usr/bin/env bash
# CI job "gloo": the CPU/gloo suite (the README's test command): every test but the hardware ones, real spawned gloo ranks. Runner: any Linux CPU machine.
# Extra arguments go to pytest (e.g. ci/gloo.sh -x -k load).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q 'tox>=4'
if [ "$#" -gt 0 ]; then exec tox -e gloo -- "$@"; else exec tox -e gloo; fi  # no "--": keep the env's default args
