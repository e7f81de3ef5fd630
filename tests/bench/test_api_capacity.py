"""bench.api_capacity end to end: the real api process, fed by the scripted engine over its ZeroMQ sockets,
streams every chunk the engine sends to the lean client, and the report counts them and the api's CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from statistics import median

import pytest
import zmq

from bench.api_capacity import NEIGHBOURS, ScriptedEngine
from shared.config import StackConfig
from shared.frames import Submit, TextBatch
from shared.transport import Inbox, Outbox


def _running_neighbours() -> list[int]:
    """Processes running one of --neighbour's loops."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(code in args for code in NEIGHBOURS.values() if code):
            found.append(int(pid))
    return found


@pytest.mark.parametrize("neighbour", ["none", "memory"])
def test_the_api_alone_streams_every_scripted_chunk_and_its_cpu_is_counted(tmp_path, neighbour):
    out = tmp_path / "api_capacity.json"
    before = _running_neighbours()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.api_capacity",
            "--streams",
            "1,3",
            "--tokens",
            "12",
            "--rounds",
            "2",
            "--step-ms",
            "1",
            "--neighbour",
            neighbour,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())
    assert len(results["rounds"]) == 2
    for round_ in results["rounds"]:
        assert round_["1"]["chunks"] == 12 and round_["3"]["chunks"] == 36  # the harness raises on a missing chunk
        for level in ("1", "3"):
            assert round_[level]["api_cpu_s"] > 0
    assert set(results["median_api_cpu_us_per_chunk"]) == {"1", "3"}
    assert " 3 streams: the api's CPU per chunk" in run.stdout
    assert results["neighbour"] == neighbour
    assert (results.get("neighbour_cpu_s", 0) > 0) == (neighbour != "none")  # it ran, on what the api left
    assert _running_neighbours() == before  # the neighbour is stopped with the api


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--streams", "0"], "stream counts must be positive"),
        (["--streams", "8,x"], "expected comma-separated stream counts"),
        (["--rounds", "0"], "must be positive"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(flags, message):
    run = subprocess.run([sys.executable, "-m", "bench.api_capacity", *flags], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert message in run.stderr


def test_the_scripted_engine_keeps_its_step_interval_below_a_millisecond(tmp_path):
    """Its steps are paced by a deadline, not by ZeroMQ's poll, whose whole milliseconds would make a 0.5 ms
    step no wait at all: a request of 20 tokens comes as 20 batches about 0.5 ms apart, the last finishing it."""
    config = StackConfig.from_argv(["--run-dir", str(tmp_path)], "test")
    ctx = zmq.Context()
    api_inbox = Inbox(ctx, config.api_address, "test_api_inbox")
    to_engine = Outbox(ctx, config.scheduler_address, "test_to_engine")
    engine = ScriptedEngine(config, step_s=0.0005)
    engine.start()
    try:
        to_engine.send(Submit(rid="r", prompt_ids=[1, 2, 3], max_tokens=20))
        arrivals, deltas = [], []
        deadline = time.monotonic() + 30
        while len(deltas) < 20 and time.monotonic() < deadline:
            for frame in api_inbox.recv(100):
                if isinstance(frame, TextBatch):
                    arrivals.append(time.monotonic())
                    deltas += frame.deltas
        assert [d.completion_tokens for d in deltas] == list(range(1, 21))
        assert deltas[-1].finish == "length" and not any(d.finish for d in deltas[:-1])
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        assert median(gaps) >= 0.0004, gaps
    finally:
        engine.stopping.set()
        engine.join(10)
        api_inbox.close()
        to_engine.close()
        ctx.term()
