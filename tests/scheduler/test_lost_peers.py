"""Peers the scheduler loses: a serving worker that reports ``failed`` (rank 0 of a tensor-parallel
worker whose other rank died) fails every request at once with the reason; an api replica that goes
silent (killed) has its requests aborted, not left to run to max_tokens."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import structlog
import zmq

from services.scheduler.loop import SchedulerLoop
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.frames import ApiAnnounce, EngineStatus, Error, Heartbeat, Submit
from shared.transport import Inbox

log = structlog.get_logger()
WHY = "tensor-parallel rank 1 (pid 4242 at 127.0.0.1:5000) is gone: it closed its connection (the process ended)"


def _frames(inbox: Inbox) -> list:
    frames: list = []
    for _ in range(20):
        got = list(inbox.recv(50))
        frames += got
        if not got and frames:
            break
    return frames


def _errors(inbox: Inbox) -> list[Error]:
    return [f for f in _frames(inbox) if isinstance(f, Error)]


@pytest.fixture
def api(tmp_path) -> Iterator[Inbox]:
    ctx = zmq.Context()
    yield Inbox(ctx, f"ipc://{tmp_path}/api.sock", "api")
    ctx.destroy(0)  # also when the test failed: a context left open blocks the interpreter's exit


def test_a_serving_worker_reporting_failed_fails_every_request_with_its_reason(tmp_path, api: Inbox) -> None:
    loop = SchedulerLoop(StackConfig(model=DEFAULT_MODEL_DIR, run_dir=str(tmp_path / "run")), log)
    for process in loop.peers:
        loop._handle(Heartbeat(process=process, pid=100, state="ready"))
    assert loop.ready
    loop._handle(ApiAnnounce(replica="api-a", address=api.address, engine="engine-0"))  # it hears statuses too
    for rid in ("running", "waiting"):
        loop._handle(Submit(rid=rid, prompt_ids=list(range(40)), max_tokens=8, reply_to=api.address))
    loop._plan_and_send()  # one request planned into a step in flight, both held
    _frames(api)
    loop._handle(Heartbeat(process="worker", pid=100, state="failed", detail=WHY))
    frames = _frames(api)
    # The api hears why before the errors: a client that sees its stream fail and asks /health learns the reason.
    assert isinstance(frames[0], EngineStatus) and frames[0].state == "failed" and WHY in frames[0].detail, frames
    errors = [f for f in frames if isinstance(f, Error)]
    assert sorted(e.rid for e in errors) == ["running", "waiting"]
    assert all(e.status == 503 and WHY in e.message for e in errors), errors
    assert not loop.core.requests and loop.core.pool.num_used == 0 and not loop.in_flight
    status = loop.status()
    assert status.state == "failed" and WHY in status.detail
    loop._handle(Heartbeat(process="worker", pid=100, state="failed", detail=WHY))  # said again: nothing more to fail
    assert _errors(api) == []


def test_requests_of_an_api_replica_that_went_silent_are_aborted(tmp_path) -> None:
    loop = SchedulerLoop(StackConfig(model=DEFAULT_MODEL_DIR, run_dir=str(tmp_path / "run"), engine_timeout_s=0.3), log)
    for process in loop.peers:
        loop._handle(Heartbeat(process=process, pid=100, state="ready"))
    owners = {name: f"ipc://{tmp_path}/{name}.sock" for name in ("api-a", "api-b")}
    for name, address in owners.items():
        loop._handle(ApiAnnounce(replica=name, address=address, engine="engine-0"))
        loop._handle(Submit(rid=f"r-{name}", prompt_ids=list(range(40)), max_tokens=8, reply_to=address))
    loop._plan_and_send()
    used = loop.core.pool.num_used
    time.sleep(0.4)  # api-a says nothing more; api-b keeps announcing
    loop._handle(ApiAnnounce(replica="api-b", address=owners["api-b"], engine="engine-0"))
    loop._send_status()
    assert list(loop.core.requests) == ["r-api-b"] and list(loop.apis) == [owners["api-b"]]
    assert 0 < loop.core.pool.num_used < used


def test_a_loading_engine_says_what_it_waits_for_and_what_the_worker_is_doing(tmp_path) -> None:
    default = SchedulerLoop(StackConfig(model=DEFAULT_MODEL_DIR, run_dir=str(tmp_path / "default")), log)
    assert default.status().detail == "waiting for worker; worker: not heard from yet"  # the api makes the text
    default.close()
    config = StackConfig(model=DEFAULT_MODEL_DIR, run_dir=str(tmp_path / "run"), detokenize_in="detokenizer")
    loop = SchedulerLoop(config, log)
    assert loop.status().detail == "waiting for worker, detokenizer; worker: not heard from yet"
    loop._handle(Heartbeat(process="detokenizer", pid=100, state="ready"))
    loop._handle(Heartbeat(process="worker", pid=101, state="loading", detail="loading weights from /m onto cpu"))
    status = loop.status()
    assert status.state == "loading" and status.detail == "waiting for worker; worker: loading weights from /m onto cpu"
