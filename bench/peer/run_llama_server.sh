#!/usr/bin/env bash
# Serves the default model's GGUF with the llama-server built by build_llama_server.sh, in the foreground:
#   bench/peer/run_llama_server.sh --parallel 8 --port 8080 [--threads 2] [--gguf PATH]
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
exec "${PYTHON:-$repo/.venv/bin/python}" -m bench.serve.peer "$@"
