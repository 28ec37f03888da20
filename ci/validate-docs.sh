#!/usr/bin/env bash
# Regenerates the validation docs from fresh runs: shardwise validate on xla_spmd over 4 and 8
# PJRT CPU devices (tox -e xla, its JSON into docs/validate/xla_spmd-N.json), with "gloo" as an
# argument also on gloo at world 1, 2, 4 and 8 (docs/validate/gloo-N.json); then the tables of
# docs/validate.md and docs/backends.md from every JSON in docs/validate/. Commit the result.
# The runs record the checked-out commit: commit your changes first (a modified tree is refused).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "$(git status --porcelain --untracked-files=no -- src)" ]; then
  echo "validate-docs: src/ has uncommitted changes; the runs would not match any commit. Commit first." >&2
  exit 1
fi
SHARDWISE_COMMIT=$(git rev-parse HEAD)
export SHARDWISE_COMMIT  # tox installs a wheel, which has no checkout to ask
if [ "${1:-}" = gloo ]; then
  for n in 1 2 4 8; do
    PYTHONPATH=src python3 -m shardwise.validate --backend gloo --nproc "$n" --json "docs/validate/gloo-$n.json"
  done
fi
python3 -m pip install -q 'tox>=4'
SHARDWISE_VALIDATE_DOCS=1 tox -e xla -- -k test_validate_spmd
PYTHONPATH=src python3 -m shardwise validate --report docs/validate/*.json --into docs/validate.md
PYTHONPATH=src python3 -m shardwise validate --report docs/validate/*.json --summary --into docs/backends.md
