#!/usr/bin/env bash
# The GPU path's one prepared check: GPU tests, then GPU benchmarks, in under eight minutes, no network.
#
#   bash bench/gpu_check.sh            # on a CUDA host, from the repository root's virtual environment
#   PY=/opt/venv/bin/python bash bench/gpu_check.sh   # e.g. inside the deploy/Dockerfile.cuda image
#
# 1. tests marked `gpu` (tests/worker/test_gpu.py): bf16 parity with transformers for every family,
#    graphed decode identical to eager over 64 steps with joins and leaves, Triton attention on the GPU;
# 2. decode step time graphed vs eager at batch 1/8/32, and the device-to-device copy bandwidth;
# 3. GB/s of the MoE (bench/moe_gpu.py, with its error against the torch path) and GDN (bench/gdn_gpu.py,
#    when present) decode kernels, to hold against the copy bandwidth of part 2;
# 4. the decoder's fusions (fused residual-add + RMSNorm, SiLU-and-mul) against their unfused torch ops:
#    time and the unfused/fused ratio, measured in the same run (bench/fusions_gpu.py).
# Each part has its own time limit; a failing part is reported and the rest still run. Exit status:
# non-zero when any part failed. Without a CUDA device it says so, shows the GPU tests skipping, and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
failed=()

part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s)"
    local began=$SECONDS
    timeout --signal=INT --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc in $((SECONDS - began))s"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device here; the GPU tests skip:"
    "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/worker/test_gpu.py
    exit 0
fi
"$PY" -c "import torch; print('gpu_check:', torch.cuda.get_device_name(), 'torch', torch.__version__, 'cuda', torch.version.cuda)"

part "gpu tests" 200 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/worker/test_gpu.py
part "decode graphed vs eager" 100 "$PY" -m bench.gpu_decode --batches 1,8,32
part "moe kernel GB/s" 60 "$PY" -m bench.moe_gpu --batches 1,8,32 --prefill 0
if [ -f bench/gdn_gpu.py ]; then
    part "gdn kernel GB/s" 75 "$PY" -m bench.gdn_gpu --batches 1,8,32
else
    echo "=== gdn kernel GB/s: bench/gdn_gpu.py is not in this tree; skipped"
fi
part "fusions fused vs unfused" 25 "$PY" -m bench.fusions_gpu --tokens 1,8,32,256,2048

if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_check: all parts passed"
