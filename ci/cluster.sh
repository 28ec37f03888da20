#!/usr/bin/env bash
# CI job "cluster": the simulated cluster (tests/cluster, about 4 minutes on 2 cores): two nodes of
# two ranks as Linux network namespaces on a bridge the tests make, SeaweedFS on a storage host.
# Runner: a Linux machine where the job runs as root with iproute2 (ip, tc) and util-linux
# (unshare); elsewhere every test skips with the reason. No traffic leaves the namespaces.
# Extra arguments go to pytest (e.g. ci/cluster.sh -x -k replicas).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q 'tox>=4'
if [ "$#" -gt 0 ]; then exec tox -e cluster -- "$@"; else exec tox -e cluster; fi
