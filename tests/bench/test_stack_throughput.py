"""bench.stack_throughput's accounting: a process's CPU time over all its threads, ended ones too; its
wake-ups; and bench.wake_cost's CPU per wake-up. Its client runs under the policy asked for, on a thread
of its own, and leaves the caller's as it was."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from bench import wake_cost
from bench.stack_throughput import paired_ratio, process_cpu_seconds, run_as_client, user_system_seconds, voluntary_switches

SPIN = "import time\nend = time.thread_time() + {seconds}\nwhile time.thread_time() < end:\n    pass\n"


def _spin(seconds: float) -> None:
    exec(SPIN.format(seconds=seconds))


def test_cpu_time_counts_threads_that_have_ended_and_not_waiting():
    before = process_cpu_seconds(os.getpid())
    worker = threading.Thread(target=_spin, args=(0.15,))
    worker.start()
    worker.join()  # its time must stay counted after it is gone
    time.sleep(0.2)  # waiting costs nothing
    spent = process_cpu_seconds(os.getpid()) - before
    assert 0.14 <= spent < 0.3, spent


def test_cpu_time_of_another_process():
    child = subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=0.3) + "import sys\nsys.stdin.read()\n"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while process_cpu_seconds(child.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # now blocked on stdin
        assert 0.3 <= process_cpu_seconds(child.pid) < 0.3 + 0.5  # the interpreter's start-up is counted too
    finally:
        child.communicate(b"")


# User-mode time: arithmetic between clock reads (reading a CPU-time clock is a system call); kernel-mode
# time: reading /dev/zero in 1 MiB reads is almost all the kernel's copying.
USER_WORK = "import time\nend = time.thread_time() + {seconds}\nwhile time.thread_time() < end:\n    sum(range(100_000))\n"
KERNEL_WORK = (
    "import time\nend = time.thread_time() + {seconds}\nf = open('/dev/zero', 'rb', buffering=0)\nwhile time.thread_time() < end:\n    f.read(1 << 20)\n"
)


@pytest.mark.parametrize(("work", "mode"), [(USER_WORK, 0), (KERNEL_WORK, 1)], ids=["user", "kernel"])
def test_user_and_kernel_time_are_told_apart(work, mode):
    child = subprocess.Popen([sys.executable, "-c", work.format(seconds=0.6) + "import sys\nsys.stdin.read()\n"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while sum(user_system_seconds(child.pid)) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        spent = user_system_seconds(child.pid)
        assert spent[mode] >= 0.4, spent  # most of the 0.6 s in the mode the work runs in (start-up aside)
        assert spent[1 - mode] < spent[mode] / 2, spent
    finally:
        child.communicate(b"")


def test_a_process_that_is_gone_is_a_clear_error():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(OSError, match=f"no CPU clock for process {child.pid}"):
        process_cpu_seconds(child.pid)


def test_wake_ups_count_the_sleeps_of_every_live_thread():
    before = voluntary_switches(os.getpid())
    sleeper = threading.Thread(target=lambda: [time.sleep(0.002) for _ in range(40)])
    sleeper.start()
    time.sleep(0.05)
    counted = voluntary_switches(os.getpid()) - before  # read while it runs: ended threads drop out of the count
    sleeper.join()
    assert counted >= 10  # each of the other thread's sleeps so far, and the main thread's one


def test_wake_cost_is_measured_in_the_woken_process(monkeypatch):
    monkeypatch.setattr(wake_cost, "WAKES", 40)
    for streams in (False, True):
        cost = wake_cost.wake_cpu_us(streams)
        assert 0 < cost < 4000, cost  # a wake-up's CPU, far below the 4 ms between wake-ups (a spinning sleeper would reach it)


def test_the_client_runs_under_its_policy_on_a_thread_of_its_own():
    caller = os.sched_getscheduler(0)
    assert run_as_client("idle", lambda: os.sched_getscheduler(0)) == os.SCHED_IDLE
    assert run_as_client("normal", lambda: os.sched_getscheduler(0)) == os.SCHED_OTHER
    assert os.sched_getscheduler(0) == caller
    with pytest.raises(ValueError, match="the client failed"):
        run_as_client("idle", lambda: (_ for _ in ()).throw(ValueError("the client failed")))


def test_the_paired_ratio_cancels_what_a_run_owes_to_its_place_in_the_round() -> None:
    # The stack reads 0.97 of the worker; whichever runs first in a round gets 8 % more: the rounds alternate.
    rounds = [0.97 * 1.08, 0.97 / 1.08] * 4 + [0.97 * 1.08]
    assert paired_ratio(rounds) == pytest.approx(0.97)
    assert sorted(rounds)[len(rounds) // 2] == pytest.approx(0.97 * 1.08)  # the plain median sides with the odd rounds
    assert paired_ratio([1.0]) is None
