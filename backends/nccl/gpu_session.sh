#!/usr/bin/env bash
# Everything shardwise checks on a CUDA machine, in one run (about 8 minutes on one H200):
#   1. `shardwise validate --backend nccl` (torchrun, one rank per GPU), JSON + markdown report;
#   2. backends/nccl/validate.sh (tests/hardware/test_nccl.py);
#   3. benchmarks/gpu_load.py: a transformers Llama loaded onto GPU 0 by shardwise and its peers.
#
#   backends/nccl/gpu_session.sh OUTDIR [SIZE]      # SIZE of the benchmark checkpoint (default 8GB)
#
# Runs from this checkout's src/ (no install); peers that are not installed are reported as not run.
# Each step has its own time limit, so one hang cannot eat the others' time.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: gpu_session.sh OUTDIR [SIZE]}"
size="${2:-8GB}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi -L
python3 -c 'import torch, transformers, safetensors; print("torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__, "safetensors", safetensors.__version__)'
status=0

echo "== 1. shardwise validate --backend nccl ($gpus rank(s))"
timeout 90 torchrun --standalone --nproc-per-node "$gpus" -m shardwise.validate --backend nccl \
    --json "$out/validate-nccl.json" --markdown "$out/validate-nccl.md" >"$out/validate.log" 2>&1 || status=1
tail -40 "$out/validate.log"

echo "== 2. backends/nccl/validate.sh"
timeout 100 bash backends/nccl/validate.sh >"$out/nccl-suite.log" 2>&1 || status=1
tail -40 "$out/nccl-suite.log"

echo "== 3. benchmarks/gpu_load.py --size $size"
(cd benchmarks && timeout 330 python3 gpu_load.py --size "$size" --repeat 3 --out "$out") \
    >"$out/gpu-load.log" 2>&1 || status=1
tail -30 "$out/gpu-load.log"
echo "== exit $status"
exit $status
