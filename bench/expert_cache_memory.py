"""The expert cache's memory bound: a worker's loading and decoding of the MoE benchmark model (its GGUF, or its
safetensors directory under ``--weight-quant int4``), each setting in a fresh process, with its peak (VmHWM) and steady (VmRSS) resident memory against non-expert weights + the cache's
bank + the KV cache + 10 %, over the process's runtime (the interpreter, the worker's libraries and the model file's
metadata, as a worker has them before it reads a weight).

    .venv/bin/python -m bench.expert_cache_memory [--model models/moe-bench.Q4_0.gguf | models/moe-bench --weight-quant int4] \\
        [--cache 25% 0] [--streams 4] [--prompt-tokens 64] [--max-tokens 32] [--cache-dir DIR] [--out bench/results/expert_cache_memory.json]

Each setting (``--cache``: an ``--expert-cache-bytes``; 0 is everything resident) runs in its own subprocess:
import the worker, load the model into a ``ModelRunner`` as a worker does, prefill ``--streams`` prompts and decode
``--max-tokens`` tokens each as one batch. Non-expert weights are every CPU tensor the process holds after loading,
the bank and the KV cache apart. Whether the page cache is what serves the misses: the store's read mode, the
bytes read from the store per decoded token (the cache's counters), and how many of the store file's pages sit in
the page cache after decoding (``mincore`` over a mapping of its descriptor), with ``/proc/meminfo`` Cached before
loading and after decoding. The model's files' pages are dropped from the page cache (``POSIX_FADV_DONTNEED``) before
each setting.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import glob
import json
import mmap
import os
import random
import subprocess
import sys
import tempfile
from typing import Any

from bench.report import write_results

MODEL = "models/moe-bench.Q4_0.gguf"
PAGE = mmap.PAGESIZE


def status() -> dict[str, int]:
    """VmHWM and VmRSS of this process, in bytes."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmHWM", "VmRSS")}


def page_cache() -> int:
    """The system's page cache (/proc/meminfo Cached), in bytes."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Cached:"))


def resident_pages(fd: int, size: int) -> int:
    """How many pages of the file behind ``fd`` (its first ``size`` bytes) are in the page cache."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    view = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)  # a private mapping: mincore still reports the file's cached pages
    vec = (ctypes.c_ubyte * -(-size // PAGE))()
    buffer = (ctypes.c_char * size).from_buffer(view)
    try:
        if libc.mincore(ctypes.c_void_p(ctypes.addressof(buffer)), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
    finally:
        del buffer
        view.close()
    return sum(v & 1 for v in vec)


def drop_from_page_cache(model: str) -> None:
    """Drops the pages of ``model`` (a GGUF file, or a directory's safetensors) from the page cache."""
    for path in [model] if os.path.isfile(model) else glob.glob(os.path.join(model, "*.safetensors")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tensor_bytes(exclude: set[int]) -> int:
    """The bytes of every CPU tensor storage alive in this process, those whose data pointers are in ``exclude`` apart."""
    import warnings

    import torch

    storages = {}
    warnings.filterwarnings("ignore", category=FutureWarning)  # isinstance on torch.distributed's deprecated proxies
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(n for ptr, n in storages.items() if ptr not in exclude)


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One setting, in this (fresh) process."""
    from services.worker.moe import routed_experts
    from services.worker.runner import ModelRunner, RunnerConfig
    from shared.config import StackConfig
    from shared.frames import SamplingParams, Slice, StepPlan

    imported = status()
    per = -(-(args.prompt_tokens + args.max_tokens + 1) // StackConfig().block_size)
    config = StackConfig(model=args.model, weight_quant=args.weight_quant, expert_cache_bytes=args.child, expert_cache_dir=args.cache_dir)
    runner_config = RunnerConfig.of(config, num_blocks=args.streams * per)  # reads the model file's metadata, as a worker does first
    runtime, cached_before = status(), page_cache()
    runner = ModelRunner(runner_config)
    loaded = status()
    cache = runner.expert_cache
    bank = cache.nbytes if cache is not None else 0
    kv = runner.kv_cache.nbytes
    vocab = runner.model.vocab_size
    prompts = [[random.Random(i).randrange(vocab) for _ in range(args.prompt_tokens)] for i in range(args.streams)]
    rids, greedy = [f"s{i}" for i in range(args.streams)], SamplingParams(temperature=0)
    outputs: dict[str, list[int]] = {rid: [] for rid in rids}
    for i, (rid, prompt) in enumerate(zip(rids, prompts)):
        for s in runner.execute(StepPlan(i, [Slice(rid, 0, len(prompt), prompt, list(range(i * per, (i + 1) * per)), sampling=greedy)])).sampled:
            outputs[s.rid].append(s.token_id)
    before = cache.describe() if cache is not None else None
    for step in range(args.max_tokens - 1):
        for s in runner.execute(StepPlan(100 + step, [Slice(rid, args.prompt_tokens + step, 1) for rid in rids])).sampled:
            outputs[s.rid].append(s.token_id)
    decoded, cached_after = status(), page_cache()
    exclude = {runner.kv_cache.tensor.untyped_storage().data_ptr()} | ({cache.records.untyped_storage().data_ptr()} if cache is not None else set())
    resident_experts = sum(moe.held_bytes() for moe in routed_experts(runner.model))
    weights = tensor_bytes(exclude) - resident_experts  # after the readings: the walk over every object costs memory of its own
    out: dict[str, Any] = {
        "expert_cache_bytes": args.child,
        "weight_quant": runner.weight_quant,
        "imported": imported,
        "runtime": runtime,
        "after_load": loaded,
        "after_decode": decoded,
        "non_expert_weight_bytes": weights,
        "resident_expert_bytes": resident_experts,
        "bank_bytes": bank,
        "kv_cache_bytes": kv,
        "bound_bytes": int((weights + bank + kv) * 1.1),
        "page_cache_before_load": cached_before,
        "page_cache_after_decode": cached_after,
        "outputs": outputs,
    }
    if cache is not None:
        after, store = cache.describe(), cache.store
        decode_tokens = (args.max_tokens - 1) * args.streams
        out |= {
            "experts": after["experts"],
            "store_bytes": store.nbytes,
            "store_reads": after["store_reads"],
            "decode_bytes_read": after["bytes_read"] - before["bytes_read"],
            "decode_bytes_read_per_token": (after["bytes_read"] - before["bytes_read"]) / decode_tokens,
            "decode_hit_rate": (after["hits"] - before["hits"]) / max(after["hits"] + after["misses"] - before["hits"] - before["misses"], 1),
            "store_pages_in_page_cache": resident_pages(store.fd, store.nbytes),
            "store_pages": store.nbytes // PAGE,
        }
    return out


def report(row: dict[str, Any]) -> None:
    mb = 1e6
    base, bound = row["runtime"]["VmRSS"], row["bound_bytes"]
    peak, steady = row["after_decode"]["VmHWM"] - base, row["after_decode"]["VmRSS"] - base
    print(
        f"--expert-cache-bytes {row['expert_cache_bytes']} (weights {row['weight_quant']}): runtime {base / mb:.0f} MB ({row['imported']['VmRSS'] / mb:.0f} once imported); above it, peak {peak / mb:.0f} MB "
        f"(at load {(row['after_load']['VmHWM'] - base) / mb:.0f}) and steady {steady / mb:.0f} MB against the bound {bound / mb:.0f} MB "
        f"(non-expert weights {row['non_expert_weight_bytes'] / mb:.0f} + bank {row['bank_bytes'] / mb:.0f} + KV {row['kv_cache_bytes'] / mb:.0f}, + 10 %): "
        f"peak/bound {peak / bound:.2f}; resident experts {row['resident_expert_bytes'] / mb:.0f} MB",
        flush=True,
    )
    if "store_bytes" in row:
        print(
            f"  experts {row['store_bytes'] / mb:.0f} MB in the store ({row['store_bytes'] / row['bank_bytes']:.1f}x the bank), reads {row['store_reads']}; "
            f"decode: {row['decode_bytes_read_per_token'] / 1e3:.0f} KB read from the store per token, hit rate {row['decode_hit_rate']:.2f}; "
            f"store pages in the page cache after decoding: {row['store_pages_in_page_cache']} of {row['store_pages']}; "
            f"page cache {row['page_cache_before_load'] / mb:.0f} MB before load, {row['page_cache_after_decode'] / mb:.0f} MB after decode",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    from shared.choices import WEIGHT_QUANTS
    from shared.config import StackConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL, help="the MoE benchmark GGUF or safetensors directory (bench.moe_model makes both)")
    parser.add_argument("--weight-quant", default=StackConfig().weight_quant, choices=WEIGHT_QUANTS, help="the worker's --weight-quant")
    parser.add_argument("--cache", nargs="+", default=["25%", "0"], help="--expert-cache-bytes settings, each in a fresh process")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cache-dir", default="", help="--expert-cache-dir (default: the worker's)")
    parser.add_argument("--out", default="bench/results/expert_cache_memory.json")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if not os.path.exists(args.model):
        subprocess.run([sys.executable, "-m", "bench.moe_model"], check=True)
    rows = []
    for spec in args.cache:
        drop_from_page_cache(args.model)
        with tempfile.NamedTemporaryFile("w+") as out:
            command = [sys.executable, "-m", "bench.expert_cache_memory", *(argv if argv is not None else sys.argv[1:]), "--child", spec]
            subprocess.run(command, check=True, stdout=out)
            out.seek(0)
            rows.append(row := json.loads(out.read().strip().splitlines()[-1]))
        report(row)
    same = [row["outputs"] == rows[0]["outputs"] for row in rows]
    print(f"greedy tokens the same in every setting: {all(same)}")
    write_results(args.out, {"args": vars(args), "rows": rows, "same_tokens": all(same)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
