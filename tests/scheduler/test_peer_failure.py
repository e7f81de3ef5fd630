"""A serving worker that reports ``failed`` (rank 0 of a tensor-parallel worker whose other rank
died) is lost at once: every request the scheduler holds ends with an error naming the reason."""

from __future__ import annotations

import structlog
import zmq

from services.scheduler.loop import SchedulerLoop
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.frames import Error, Heartbeat, Submit
from shared.transport import Inbox

log = structlog.get_logger()
WHY = "tensor-parallel rank 1 (pid 4242 at 127.0.0.1:5000) is gone: it closed its connection (the process ended)"


def _errors(inbox: Inbox) -> list[Error]:
    frames: list = []
    for _ in range(20):
        got = list(inbox.recv(50))
        frames += got
        if not got and frames:
            break
    return [f for f in frames if isinstance(f, Error)]


def test_a_serving_worker_reporting_failed_fails_every_request_with_its_reason(tmp_path) -> None:
    ctx = zmq.Context()
    api = Inbox(ctx, f"ipc://{tmp_path}/api.sock", "api")
    loop = SchedulerLoop(StackConfig(model=DEFAULT_MODEL_DIR, run_dir=str(tmp_path / "run")), log)
    for process in ("worker", "detokenizer"):
        loop._handle(Heartbeat(process=process, pid=100, state="ready"))
    assert loop.ready
    for rid in ("running", "waiting"):
        loop._handle(Submit(rid=rid, prompt_ids=list(range(40)), max_tokens=8, reply_to=api.address))
    loop._plan_and_send()  # one request planned into a step in flight, both held
    _errors(api)
    loop._handle(Heartbeat(process="worker", pid=100, state="failed", detail=WHY))
    errors = _errors(api)
    assert sorted(e.rid for e in errors) == ["running", "waiting"]
    assert all(e.status == 503 and WHY in e.message for e in errors), errors
    assert not loop.core.requests and loop.core.pool.num_used == 0 and not loop.in_flight
    status = loop.status()
    assert status.state == "failed" and WHY in status.detail
    loop._handle(Heartbeat(process="worker", pid=100, state="failed", detail=WHY))  # said again: nothing more to fail
    assert _errors(api) == []
    ctx.destroy(0)
