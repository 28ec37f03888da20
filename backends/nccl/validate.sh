#!/usr/bin/env bash
# Validate the nccl backend on this machine's GPUs and print a summary.
#
#   backends/nccl/validate.sh            # from anywhere; uses python3 (or $PYTHON)
#
# Needs a CUDA build of torch, safetensors, pytest and numpy in that python
# (pip install -r backends/nccl/requirements.txt). Runs tests/hardware/test_nccl.py with one
# rank per visible GPU (a world of one on one GPU; pick GPUs with CUDA_VISIBLE_DEVICES),
# from this checkout's src/ (no install needed). Exit status: pytest's.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
LOG="$(mktemp -t shardwise-nccl.XXXXXX.log)"

echo "== shardwise nccl validation: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')"
"$PY" - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL "
      f"{'.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else '-'}, "
      f"{torch.cuda.device_count()} GPU(s): "
      + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
PY

start=$(date +%s)
PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" timeout 900 "$PY" -m pytest -m nccl tests/hardware/test_nccl.py \
    -p no:cacheprovider -s -rA -q >"$LOG" 2>&1
status=$?
elapsed=$(( $(date +%s) - start ))

echo "== checks"
grep '^shardwise nccl:' "$LOG" || echo "(none printed)"
echo "== pytest"
grep -E '^(PASSED|FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed|skipped|error)' "$LOG" | tail -20
if [ "$status" -ne 0 ]; then
    echo "== failure output (last 80 lines of $LOG)"
    tail -80 "$LOG"
fi
if [ "$status" -ne 0 ]; then
    result="FAIL (exit $status)"
elif grep -qE '[0-9]+ passed' "$LOG"; then
    result=PASS
else
    result="NOT RUN (every check skipped: no usable GPU)"
fi
echo "== result: $result in ${elapsed}s; full log: $LOG"
exit "$status"
