#!/usr/bin/env bash
# The MoE comparison with llama.cpp: tokenyard and llama-server on the MoE benchmark model (bench/moe_model.py),
# the same weights in one bench.serve run, at c=1 / 8 / 32 on chat-128. Makes the model and builds the peer
# where they are missing, then keeps the run's summary.json, plot.png and a COMMAND file (the commands, the
# commit, the machine, the ratios) in bench/reference/serve-moe-chat128/ (the raw run stays under bench/results/).
#
#   bench/peer/moe_reference.sh                                   # tokenyard serves the Q4_0 GGUF llama-server serves
#   STACK_MODEL=models/moe-bench bench/peer/moe_reference.sh      # tokenyard serves the HF (bf16) directory instead
#
# Settings (environment): STACK_MODEL (default models/moe-bench.Q4_0.gguf), STACK_ARGS (extra launcher flags),
# PEER_GGUF (default models/moe-bench.Q4_0.gguf), WORKLOAD (default chat-128), CONCURRENCY (default "1 8 32"),
# NAME (default serve-moe-<workload>, the reference directory), REFERENCE=0 to leave bench/reference/ alone.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
python=${PYTHON:-.venv/bin/python}
stack_model=${STACK_MODEL:-models/moe-bench.Q4_0.gguf}
peer_gguf=${PEER_GGUF:-models/moe-bench.Q4_0.gguf}
workload=${WORKLOAD:-chat-128}
concurrency=${CONCURRENCY:-1 8 32}
name=${NAME:-serve-moe-${workload//-/}}
out=bench/results/$name

[ -x bench/peer/build/bin/llama-server ] && [ -x bench/peer/build/bin/llama-quantize ] || nice -n 19 bench/peer/build_llama_server.sh
[ -f models/moe-bench/model.safetensors ] && [ -f models/moe-bench.Q4_0.gguf ] || "$python" -m bench.moe_model

read -ra levels <<< "$concurrency"
serve=("$python" -m bench.serve --start-stack --stack-model "$stack_model" --start-peer --peer-gguf "$peer_gguf"
  --workload "bench/workloads/$workload.json" --concurrency "${levels[@]}" --stack-log "$out.stack.log" --out "$out")
[ -n "${STACK_ARGS:-}" ] && serve+=(--stack-args "$STACK_ARGS")
status=0
"${serve[@]}" || status=$?

if [ "${REFERENCE:-1}" != 0 ] && [ -f "$out/summary.json" ]; then
  mkdir -p "bench/reference/$name"
  cp "$out/summary.json" "$out/plot.png" "bench/reference/$name/"
  "$python" - "$out/summary.json" "$stack_model" "$peer_gguf" "${serve[*]}" > "bench/reference/$name/COMMAND" <<'EOF'
import json, sys
summary, stack_model, peer_gguf, command = json.load(open(sys.argv[1])), *sys.argv[2:]
p = summary["provenance"]
m, git = p["machine"], p["git"]
print(f"# {summary['workload']['name']} against llama.cpp on the MoE benchmark model (python -m bench.moe_model: seed 0, uniform routing),"
      f" at {git['commit'][:7]}{' (dirty tree)' if git['dirty'] else ''}: tokenyard serving {stack_model}, llama-server {peer_gguf}.")
print(f"# Machine: {m['cpu_model']}, {m['cores']} cores, {m['memory_gib']} GiB, load average {m['load_average'][0]:.2f} at the start;"
      f" peer: {' '.join((p['settings'].get('peer_build') or '').split())}")
print("bench/peer/moe_reference.sh  # which runs:")
print(command)
by = {(r["endpoint"], r["label"]): r["summary"] for r in summary["results"]}
for row in summary["ratios"]:
    a, b = by[(row["numerator"], row["label"])], by[(row["denominator"], row["label"])]
    print(f"# {row['numerator']}/{row['denominator']} {row['label']}: output tokens/s {row['ratios']['output_throughput']:.2f}x"
          f" ({a['output_throughput']:.1f} vs {b['output_throughput']:.1f}), TTFT p99 {a['ttft_s']['p99'] * 1e3:.0f} vs {b['ttft_s']['p99'] * 1e3:.0f} ms,"
          f" ITL p50 {a['itl_s']['p50'] * 1e3:.1f} vs {b['itl_s']['p50'] * 1e3:.1f} ms")
print(f"# complete: {summary['complete']}" + "".join(f"; {reason}" for reason in summary["incomplete_reasons"]))
EOF
  echo "kept bench/reference/$name/ (summary.json, plot.png, COMMAND)"
fi
exit $status
