#!/usr/bin/env bash
# CI job "latest": the Hugging Face suite (tests/hf, tests/docs) against the newest transformers,
# diffusers, accelerate, PEFT, huggingface_hub and safetensors, where every other env takes
# ci/constraints.txt's pins. It prints what differs from the pins first; where nothing does, the
# hf env has just run the same suite on the same versions and this one says so and stops
# (SHARDWISE_LATEST_FORCE=1 runs it anyway). A failure here with the hf env green is one of
# the upstream changes it printed. Runner: any Linux CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q 'tox>=4'
if [ "$#" -gt 0 ]; then exec tox -e latest -- "$@"; else exec tox -e latest; fi
