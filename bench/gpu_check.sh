#!/usr/bin/env bash
# The GPU path's one prepared check: GPU tests, GPU benchmarks, then the stack serving from the GPU; about five minutes, no network.
#
#   bash bench/gpu_check.sh            # on a CUDA host, from the repository root's virtual environment
#   PY=/opt/venv/bin/python bash bench/gpu_check.sh   # e.g. inside the deploy/Dockerfile.cuda image
#
# 1. tests marked `gpu` (tests/worker/test_gpu.py): bf16 parity with transformers for every family,
#    graphed decode identical to eager over 64 steps with joins and leaves, Triton attention on the GPU,
#    a MoE model from an expert cache in device memory (co-execution's measured rates printed);
# 2. decode step time graphed vs eager at batch 1/8/32, and the device-to-device copy bandwidth;
# 3. GB/s of the MoE (bench/moe_gpu.py, with its error against the torch path) and GDN (bench/gdn_gpu.py,
#    when present) decode kernels, to hold against the copy bandwidth of part 2;
# 4. the decoder's fusions (fused residual-add + RMSNorm, SiLU-and-mul) against their unfused torch ops:
#    time and the unfused/fused ratio, measured in the same run (bench/fusions_gpu.py);
# 5. the whole stack on the GPU: greedy completions through its four processes equal transformers' on a tiny
#    random model (bench/gpu_stack_check.py);
# 6. serving on the GPU: bench.serve's chat-128 workload at concurrency 1/8/32 against the stack on a random
#    checkpoint of the default model's shapes (its weights need not travel), and the in-process graphed decode
#    step of that checkpoint, the stack's ceiling.
# Results (logs, the serving summary and plot) go under $GPU_CHECK_OUT (default /tmp/gpu_check). SmolLM2's
# tokenizer files are read from $TOKENIZER_DIR (default: the embedded default model's directory).
# Each part has its own time limit; a failing part is reported and the rest still run. Exit status:
# non-zero when any part failed. Without a CUDA device it says so, shows the GPU tests skipping, and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT_DIR=${GPU_CHECK_OUT:-/tmp/gpu_check}
TOKENIZER_DIR=${TOKENIZER_DIR:-models/SmolLM2-135M-Instruct}
mkdir -p "$OUT_DIR"
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

finish() {
    if [ ${#failed[@]} -gt 0 ]; then
        echo "gpu_check: FAILED: ${failed[*]}"
        exit 1
    fi
    echo "gpu_check: all parts passed"
    exit 0
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
if [ ! -f "$TOKENIZER_DIR/tokenizer.json" ]; then
    echo "=== stack and serving on the gpu: no SmolLM2 tokenizer at $TOKENIZER_DIR (set TOKENIZER_DIR); skipped"
    finish
fi
part "stack on the gpu" 150 "$PY" -m bench.gpu_stack_check --tokenizer "$TOKENIZER_DIR" --log "$OUT_DIR/stack.log" --out "$OUT_DIR/instrumentation.json"
serving_model=$(mktemp -d)/smollm2-135m-random
part "random smollm2-135m checkpoint" 60 "$PY" -m shared.devtools.random_model "$serving_model" --shape smollm2-135m --dtype bfloat16 --tokenizer "$TOKENIZER_DIR"
part "serving chat-128 on the gpu" 200 "$PY" -m bench.serve --start-stack --stack-model "$serving_model" --stack-args "--device cuda" --stack-log "$OUT_DIR/serve-stack.log" \
    --workload bench/workloads/chat-128.json --concurrency 1 8 32 --out "$OUT_DIR/serve-gpu"
part "in-process decode of that checkpoint" 60 "$PY" -m bench.gpu_decode --model "$serving_model" --batches 1,8,32 --context 96

finish
