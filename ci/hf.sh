#!/usr/bin/env bash
# CI job "hf": the suite against real transformers and diffusers models (tests/hf) and the README's and docs' code blocks (tests/docs), in its own env so the gloo env stays minimal. Runner: any Linux CPU machine.
# Extra arguments go to pytest (e.g. ci/hf.sh -x -k load).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q 'tox>=4'
if [ "$#" -gt 0 ]; then exec tox -e hf -- "$@"; else exec tox -e hf; fi  # no "--": keep the env's default args
