#!/usr/bin/env bash
# llama-server held to a memory budget, as the expert cache holds tokenyard's worker to --expert-cache-bytes: a
# memory cgroup around it (v1's memory controller, else v2), in which its memory map of the GGUF pages in and out.
# llama.cpp repacks Q4_0 weights into anonymous memory by default, which a budget below the model's size cannot
# hold (the cgroup kills it), so it runs with --no-repack: the weights stay in the map. Needs root.
#
#   bench/peer/llama_server_in_memory_cgroup.sh BYTES PORT PARALLEL GGUF [more llama-server flags]
#
# The page cache is dropped first: pages of the GGUF cached outside the cgroup would not count against it. The
# cgroup (tokenyard-peer-<pid>) is left behind, empty, when llama-server exits.
set -euo pipefail
[ $# -ge 4 ] || { sed -n '2,8p' "$0" >&2; exit 2; }
bytes=$1 port=$2 parallel=$3 gguf=$4
shift 4
name=tokenyard-peer-$$
if [ -d /sys/fs/cgroup/memory ]; then
    dir=/sys/fs/cgroup/memory/$name
    mkdir -p "$dir"
    echo "$bytes" > "$dir/memory.limit_in_bytes"
elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    dir=/sys/fs/cgroup/$name
    mkdir -p "$dir"
    echo "$bytes" > "$dir/memory.max"
else
    echo "no memory cgroup on this machine" >&2
    exit 2
fi
sync
echo 3 > /proc/sys/vm/drop_caches
echo $$ > "$dir/cgroup.procs"
exec "${LLAMA_SERVER:-bench/peer/build/bin/llama-server}" -m "$gguf" --host 127.0.0.1 --port "$port" -t "${THREADS:-2}" -tb "${THREADS:-2}" \
    --parallel "$parallel" -c 2048 --cont-batching --no-webui --no-repack "$@"
