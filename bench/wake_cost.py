"""What one wake-up of a sleeping process costs this machine, in CPU time: the floor under every hop.

Each output token wakes the scheduler, the detokenizer, the api and the client at least once (one
stream: one token per step), and where the worker fills the cores that CPU comes out of the worker's.
A process sleeps in poll() on a pipe and is woken every 4 ms with one byte; its CPU time per wake-up
is measured with its core idle, and with its core shared by a process that streams memory (as the
worker's threads do: the woken process then finds its caches and TLB cold). On a virtual machine
this is tens of microseconds before any Python runs; bench.stack_throughput prints it beside its
wake-ups per token.

    python -m bench.wake_cost
"""

from __future__ import annotations

import os
import select
import time

WAKES = 500
PERIOD_S = 0.004
_STREAM_BYTES = 64 << 20  # far beyond any L2 and most L3 shares


def _sleeper(read_fd: int, core: int) -> None:
    os.sched_setaffinity(0, {core})
    poller = select.poll()
    poller.register(read_fd, select.POLLIN)
    for _ in range(WAKES):
        poller.poll(-1)
        os.read(read_fd, 1)


def _streamer(core: int) -> None:
    os.sched_setaffinity(0, {core})
    os.nice(19)  # it yields to the sleeper at once, as a pool helper does to a woken service
    memory = bytes(_STREAM_BYTES)
    while True:
        memory.find(b"\x01")  # reads every byte (a copy would use non-temporal stores, which spare the caches)


def _fork(target, *args) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            target(*args)
        finally:
            os._exit(0)
    return pid


def wake_cpu_us(neighbour_streams: bool) -> float:
    """CPU microseconds per wake-up of a process on the last allowed core (the one the stack's services use)."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[-1]
    streamer = _fork(_streamer, core) if neighbour_streams else None
    read_fd, write_fd = os.pipe()
    try:
        time.sleep(0.2)
        sleeper = _fork(_sleeper, read_fd, core)
        for _ in range(WAKES):
            time.sleep(PERIOD_S)
            os.write(write_fd, b"x")
        _, _, usage = os.wait4(sleeper, 0)
        return 1e6 * (usage.ru_utime + usage.ru_stime) / WAKES
    finally:
        os.close(read_fd)
        os.close(write_fd)
        if streamer is not None:
            os.kill(streamer, 9)
            os.waitpid(streamer, 0)


def measure() -> dict[str, float]:
    return {"idle_core_us": wake_cpu_us(False), "streaming_core_us": wake_cpu_us(True)}


if __name__ == "__main__":
    costs = measure()
    print(
        f"CPU per wake-up of a sleeping process: {costs['idle_core_us']:.1f} us on an idle core, {costs['streaming_core_us']:.1f} us on a core that streams memory"
    )
