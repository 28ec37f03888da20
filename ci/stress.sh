#!/usr/bin/env bash
# CI job "stress": the stress suites at a small N (tests/stress: the fuzzer over mutated
# checkpoints, SIGKILLs during every kind of save, ranks that die during loads and saves), and the
# longest multi-rank runs of tests/dist (marker long: eight ranks, two simulated nodes), on
# the CPU/gloo env's requirements. Runner: any CPU machine. SHARDWISE_STRESS_N (fuzz cases,
# default 40) and SHARDWISE_STRESS_KILLS (trials per kind, default 1) make it longer.
# Extra arguments go to pytest (e.g. ci/stress.sh -x -k fuzz).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q 'tox>=4'
if [ "$#" -gt 0 ]; then exec tox -e stress -- "$@"; else exec tox -e stress; fi
