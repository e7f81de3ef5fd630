"""Stands in for llama-server in tests: takes its command line, prints the slots it was given, serves the fake
OpenAI routes and /health on --port until SIGINT."""

from __future__ import annotations

import argparse
import signal
import threading

from tests.bench.fake_openai import FakeOpenAI


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parallel", type=int, required=True)
    parser.add_argument("-t", type=int, required=True)
    parser.add_argument("-tb", type=int, required=True)
    args, extra = parser.parse_known_args()
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with FakeOpenAI(model=f"parallel-{args.parallel}", port=args.port):
        print(f"fake llama-server: parallel {args.parallel} threads {args.t} model {args.m} then {' '.join(extra)}", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
