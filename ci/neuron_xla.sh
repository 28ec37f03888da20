#!/usr/bin/env bash
# CI job "neuron_xla": the Trainium/Inferentia suite on the torch_xla-based torch-neuronx 2.9 (tests/hardware/xla_multiprocess.py under torchrun, one rank per NeuronCore). Runner: a trn1/inf2 instance on Neuron SDK 2.31 or earlier.
# Extra arguments go to pytest (e.g. ci/neuron_xla.sh -x).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q 'tox>=4'
export PIP_EXTRA_INDEX_URL="${PIP_EXTRA_INDEX_URL:-https://pip.repos.neuron.amazonaws.com}"
if [ "$#" -gt 0 ]; then exec tox -e neuron_xla -- "$@"; else exec tox -e neuron_xla; fi  # no "--": keep the env's default args
