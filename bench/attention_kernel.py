"""CPU attention kernel benchmark: ``paged_decode_attention`` (``csrc/paged_decode_attention.cpp``, the
``cpp`` backend) on the default model's shapes (9 query heads, 3 kv heads, head_dim 64, block size 8,
fp16 cache), per call, for three steps: a decode batch of 32 requests with contexts of 100-300 tokens, with
its cache in L3 (one cache, called again and again) and cold (30 layers' caches called in turn, as a model
step does: ~150 MB, past any cache), and a 512-row prefill chunk of one request (row i attends over
positions [0, i + 1)). Block tables are shuffled, as a running cache's are. Prints the time per call (per layer) and GMAC/s, counting 2 * heads * head_dim
multiply-adds per position per row (q . k and p * v).

To compare against another build of the kernel (say the previous version, compiled under another
extension name), pass ``--baseline module:attribute`` naming a Python callable that returns a module
with the same ``paged_decode_attention``; the two are then timed alternately in the same run, and
their results compared.

    .venv/bin/python -m bench.attention_kernel [--repeats 5] [--threads 2] [--baseline /tmp/oldattn/build.py:load]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import random
import time
from collections.abc import Callable
from types import ModuleType

import torch

from services.worker.cpu_kernels import cpu_kernels

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 8


def step(lens: list[int], tables_from: list[int], layers: int = 1) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """q [rows, heads, dim], ``layers`` fp16 caches, block tables and context lengths; row r belongs to
    request tables_from[r] and attends over lens[r] positions."""
    requests = max(tables_from) + 1
    longest = [max(n for n, t in zip(lens, tables_from) if t == req) for req in range(requests)]
    blocks = [-(-n // BLOCK) for n in longest]
    free = list(range(sum(blocks)))
    random.Random(0).shuffle(free)
    width = max(blocks)
    tables = torch.zeros(requests, width, dtype=torch.int32)
    for req, n in enumerate(blocks):
        tables[req, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    caches = [torch.randn(sum(blocks) * BLOCK, 2, KV_HEADS, DIM).half() for _ in range(layers)]
    q = torch.randn(len(lens), HEADS, DIM)
    return q, caches, tables[tables_from].contiguous(), torch.tensor(lens, dtype=torch.int32)


def call_layers(kernels: ModuleType, q: torch.Tensor, caches: list[torch.Tensor], tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The kernel over each layer's cache in turn; the last layer's output."""
    for cache in caches:
        out = kernels.paged_decode_attention(q, cache, tables, lens, BLOCK, DIM**-0.5)
    return out


def per_call_s(fn: Callable[[], object], min_s: float) -> float:
    """The fastest of the calls made in min_s seconds: on a shared machine a slower call is one that
    waited for a core, not one that did more work."""
    fn()
    best, began = float("inf"), time.perf_counter()
    while time.perf_counter() - began < min_s:
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def load_baseline(spec: str) -> ModuleType:
    path, attribute = spec.rsplit(":", 1)
    module_spec = importlib.util.spec_from_file_location("attention_baseline", path)
    assert module_spec is not None and module_spec.loader is not None, f"cannot import {path}"
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, attribute)()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="alternating measurements of each kernel per shape")
    parser.add_argument("--min-s", type=float, default=0.3, help="seconds of calls per measurement")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--baseline", help="path/to/file.py:callable returning another build of the kernels")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels, why = cpu_kernels()
    if kernels is None:
        print(f"attention_kernel: the C++ kernels did not build ({why}); skipped")
        return
    candidates = {"current": kernels}
    if args.baseline:
        candidates = {"baseline": load_baseline(args.baseline), **candidates}
    rng = random.Random(1)
    decode_lens = [rng.randint(100, 300) for _ in range(32)]
    shapes = {
        "decode 32 x 100-300": step(decode_lens, list(range(32))),
        "cold decode 32": step(decode_lens, list(range(32)), layers=30),
        "prefill 512 rows": step(list(range(1, 513)), [0] * 512),
    }
    print(f"attention_kernel: {torch.get_num_threads()} threads, {HEADS} heads / {KV_HEADS} kv heads of {DIM}, block {BLOCK}, fp16 cache")
    print(f"{'shape':>20} {'kernel':>9} {'ms/layer':>9} {'GMAC/s':>7}")
    for name, (q, caches, tables, lens) in shapes.items():
        macs = 2 * HEADS * DIM * int(lens.sum()) * len(caches)  # a call: every cache (layer) in turn
        calls = {key: functools.partial(call_layers, m, q, caches, tables, lens) for key, m in candidates.items()}
        results = {key: call() for key, call in calls.items()}
        if "baseline" in results:
            torch.testing.assert_close(results["current"], results["baseline"], rtol=1e-5, atol=1e-5)
        times: dict[str, list[float]] = {key: [] for key in calls}
        for _ in range(args.repeats):
            for key, call in calls.items():
                times[key].append(per_call_s(call, args.min_s))
        for key, ts in times.items():
            best = min(ts)
            print(f"{name:>20} {key:>9} {best * 1e3 / len(caches):9.3f} {macs / best / 1e9:7.1f}")
        if "baseline" in times:
            print(f"{name:>20} {'ratio':>9} {min(times['baseline']) / min(times['current']):9.2f}x  (baseline / current, best of {args.repeats})")


if __name__ == "__main__":
    main()
