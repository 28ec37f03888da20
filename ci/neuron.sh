#!/usr/bin/env bash
# CI job "neuron": the Trainium suite on TorchNeuron (torch-neuronx 2.13/2.14, native): shardwise validate under torchrun, one rank per NeuronCore (SHARDWISE_NEURON_NPROC, default 2). Runner: a trn2/trn3 instance with the Neuron driver and the Neuron package repository.
# Extra arguments go to pytest (e.g. ci/neuron.sh -x).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q 'tox>=4'
export PIP_EXTRA_INDEX_URL="${PIP_EXTRA_INDEX_URL:-https://pip.repos.neuron.amazonaws.com}"
if [ "$#" -gt 0 ]; then exec tox -e neuron -- "$@"; else exec tox -e neuron; fi  # no "--": keep the env's default args
