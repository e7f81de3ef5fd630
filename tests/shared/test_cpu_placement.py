"""--worker-core: the worker's main thread on one CPU alone, the stack's other threads on the rest."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from shared.config import StackConfig
from shared.cpu_placement import worker_core

CPUS = sorted(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="placement needs two CPUs")


def config(*flags: str) -> StackConfig:
    return StackConfig.from_argv(["--device", "cpu", *flags])


@needs_two_cpus
def test_auto_gives_the_worker_the_first_allowed_cpu_and_a_number_picks_another() -> None:
    assert worker_core(config()) == CPUS[0]
    assert worker_core(config("--worker-core", str(CPUS[-1]))) == CPUS[-1]


@pytest.mark.parametrize(
    "flags",
    [("--worker-core", "off"), ("--device", "cuda"), ("--replicas", "2"), ("--tensor-parallel-size", "2")],
    ids=["off", "gpu", "replicas", "tensor-parallel"],
)
def test_no_placement_when_off_on_a_gpu_or_with_more_than_one_worker_main_thread(flags: tuple[str, ...]) -> None:
    assert worker_core(config(*flags)) is None


def test_a_bad_value_or_a_cpu_outside_the_allowed_set_stops_with_the_flag_named() -> None:
    with pytest.raises(SystemExit, match="--worker-core must be auto, off or a CPU number"):
        worker_core(config("--worker-core", "first"))
    if len(CPUS) >= 2:
        with pytest.raises(SystemExit, match="--worker-core 4096 is not among"):
            worker_core(config("--worker-core", "4096"))


PLACE = textwrap.dedent(
    """
    import json, os, sys, threading
    from shared.config import StackConfig
    from shared.cpu_placement import keep_off_worker_core, take_worker_core
    config = StackConfig.from_argv(["--device", "cpu"])
    if sys.argv[1] == "service":
        keep_off_worker_core(config)
        started = threading.Thread(target=lambda: print(json.dumps(sorted(os.sched_getaffinity(0)))))  # a thread started afterwards
        started.start(); started.join()
    else:
        ready, done = threading.Event(), threading.Event()
        def helper():
            ready.set(); done.wait()
        thread = threading.Thread(target=helper); thread.start(); ready.wait()  # a helper that exists before placement
        take_worker_core(config)
        print(json.dumps([sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(thread.native_id))]))
        done.set(); thread.join()
    """
)


def place(role: str):
    import json

    out = subprocess.run([sys.executable, "-c", PLACE, role], capture_output=True, text=True, check=True, cwd=os.getcwd()).stdout
    return json.loads(out)


@needs_two_cpus
def test_services_and_their_later_threads_keep_off_the_worker_cpu() -> None:
    assert place("service") == CPUS[1:]


@needs_two_cpus
def test_the_worker_main_thread_takes_its_cpu_and_its_existing_threads_the_rest() -> None:
    main_cpus, helper_cpus = place("worker")
    assert main_cpus == [CPUS[0]]
    assert helper_cpus == CPUS[1:]
