"""Which CPUs the stack's threads run on, where the worker computes on the CPU (``--worker-core``).

The worker's threads fill the cores, and the api, scheduler and detokenizer wake on the same cores for
every token. What a wake-up costs depends on which worker thread it preempts:
- the worker's main thread runs the step: while it is off its core, the step stands still;
- a helper of the worker's few-row pool (csrc/takeover_pool.h) can be preempted at no more than its
  own share: the main thread takes its unfinished items over instead of waiting for it.
So the main thread gets one core to itself and everything else runs on the others: the api, scheduler
and detokenizer from their start, and the worker's other threads (its pool helpers, OpenMP's and ZMQ's)
from the end of its warm-up, when they all exist (a thread starts on its creator's CPUs, so placing
the main thread earlier would crowd every helper created after it onto its core).

Only for one worker on the host: with several replicas or tensor-parallel ranks, two main threads
would claim the same core.
"""

from __future__ import annotations

import os
import threading

from shared.config import StackConfig


def worker_core(config: StackConfig) -> int | None:
    """The CPU the worker's main thread keeps to itself, or None where every thread may run anywhere."""
    if config.worker_core == "off":
        return None
    if config.worker_core != "auto" and not config.worker_core.isdigit():
        raise SystemExit(f"--worker-core must be auto, off or a CPU number, got {config.worker_core!r}")
    if config.device == "cuda" or (config.device == "auto" and os.path.exists("/dev/nvidiactl")):
        return None  # a GPU worker's main thread mostly waits on the device
    if config.replicas > 1 or config.tensor_parallel_size > 1:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None
    if config.worker_core == "auto":
        return allowed[0]
    core = int(config.worker_core)
    if core not in allowed:
        raise SystemExit(f"--worker-core {core} is not among this process's CPUs {allowed}")
    return core


def keep_off_worker_core(config: StackConfig) -> set[int] | None:
    """For the api, scheduler and detokenizer, at their start (before they start threads, which inherit
    it): every allowed CPU but the worker's. Returns the CPUs kept, or None when nothing changed."""
    core = worker_core(config)
    if core is None:
        return None
    others = os.sched_getaffinity(0) - {core}
    os.sched_setaffinity(0, others)
    return others


def take_worker_core(config: StackConfig) -> int | None:
    """For the worker, on its main thread once warm: that thread on the worker's CPU alone, every other
    thread of the process on the remaining CPUs. Returns the core, or None when nothing changed."""
    core = worker_core(config)
    if core is None:
        return None
    others = os.sched_getaffinity(0) - {core}
    me = threading.get_native_id()
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid != me:
            try:
                os.sched_setaffinity(tid, others)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
    os.sched_setaffinity(0, {core})
    return core
