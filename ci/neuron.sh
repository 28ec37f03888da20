#!/usr/bin/env bash
# CI job "neuron": the Trainium/Inferentia suite (torch_neuronx, one rank per NeuronCore). Runner: a trn1/inf2 instance with the Neuron SDK.
# Extra arguments go to pytest (e.g. ci/neuron.sh -x -k load).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q 'tox>=4'
if [ "$#" -gt 0 ]; then exec tox -e neuron -- "$@"; else exec tox -e neuron; fi  # no "--": keep the env's default args
