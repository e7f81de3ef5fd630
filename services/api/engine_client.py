"""The api's side of the engine: submits requests, routes text deltas back to their streams.

Each in-flight request has one queue. A request ends exactly once: with a finishing
delta, an engine error, or an abort sent when its consumer goes away early.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Protocol

import structlog
import zmq
import zmq.asyncio

from services.api.errors import ApiError
from shared.config import StackConfig
from shared.frames import Abort, EngineStatus, Error, FinishReason, Submit, TextBatch, TextDelta
from shared.metrics import FRAMES_UNEXPECTED
from shared.transport import AsyncInbox, Curve, Outbox, stop_authenticator

log = structlog.get_logger()

_FAILED = {  # finish reasons that end a request without a result
    FinishReason.ERROR.value: (500, "the engine failed this request"),
    FinishReason.ABORT.value: (503, "the engine aborted this request"),
}


class Engine(Protocol):
    """What the api's handlers need from the engine; ``EngineClient`` over ZeroMQ, or a scripted stand-in in tests.

    ``generate`` yields a request's deltas up to and including the finishing one, raises
    ApiError if the engine refuses or fails it, and aborts it if closed early.
    """

    status: EngineStatus
    streams: dict[str, asyncio.Queue[TextDelta | ApiError]]

    @property
    def ready(self) -> bool: ...

    def start(self) -> None: ...

    async def close(self) -> None: ...

    def describe_state(self) -> tuple[str, str]: ...

    def addresses(self) -> dict[str, str]: ...

    def generate(self, submit: Submit) -> AsyncIterator[TextDelta]: ...


class EngineClient:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.ctx = zmq.asyncio.Context()
        curve = Curve.from_file(config.curve_key_file)
        self.inbox = AsyncInbox(self.ctx, config.api_address, "api_inbox", curve)
        self.to_scheduler = Outbox(self.ctx, config.scheduler_address, "api_to_scheduler", curve)
        self.streams: dict[str, asyncio.Queue[TextDelta | ApiError]] = {}
        self.status = EngineStatus(state="loading", detail="no word from the scheduler yet")
        self.status_seen = 0.0
        self._receiver: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None

    # Lifecycle. ------------------------------------------------------------------------

    def start(self) -> None:
        self._receiver = asyncio.create_task(self._receive())
        self._watchdog = asyncio.create_task(self._watch())

    async def close(self) -> None:
        for task in (self._receiver, self._watchdog):
            if task is not None:
                task.cancel()
        self.inbox.close()
        self.to_scheduler.close()
        stop_authenticator(self.ctx)
        self.ctx.term()

    def addresses(self) -> dict[str, str]:
        return {"inbox": self.inbox.address, "scheduler": self.to_scheduler.address}

    # Health. ---------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return time.monotonic() - self.status_seen < self.config.engine_timeout_s

    @property
    def ready(self) -> bool:
        return self.connected and self.status.state == "ready"

    def describe_state(self) -> tuple[str, str]:
        if not self.status_seen:
            return "loading", "waiting for the scheduler"
        if not self.connected:
            return "unavailable", f"no status from the scheduler for over {self.config.engine_timeout_s:g}s"
        return self.status.state, self.status.detail

    # Requests. -------------------------------------------------------------------------

    async def generate(self, submit: Submit) -> AsyncIterator[TextDelta]:
        """Yields the request's text deltas up to and including the finishing one.

        Raises ApiError if the engine refuses or fails the request. Closing the iterator
        early (client gone) aborts the request in the engine.
        """
        if not self.ready:
            state, detail = self.describe_state()
            raise ApiError(503, f"the engine is not ready ({state}: {detail})", headers={"Retry-After": "1"})
        queue: asyncio.Queue[TextDelta | ApiError] = asyncio.Queue()
        self.streams[submit.rid] = queue
        outcome = "aborted"  # unless a finishing delta or an error arrives
        log.info("request_submitted", rid=submit.rid, prompt_tokens=len(submit.prompt_ids), max_tokens=submit.max_tokens)
        try:
            self.to_scheduler.send(submit)
            while True:
                item = await queue.get()
                if isinstance(item, ApiError):
                    outcome = f"error {item.status}"
                    raise item
                if item.finish in _FAILED:
                    outcome = f"error {_FAILED[item.finish][0]}"
                    raise ApiError(*_FAILED[item.finish])
                if item.finish:
                    outcome = item.finish
                yield item
                if item.finish:
                    return
        finally:
            self.streams.pop(submit.rid, None)
            if outcome == "aborted":
                self.to_scheduler.send(Abort(rid=submit.rid))
            log.info("request_ended", rid=submit.rid, outcome=outcome)

    # Receiving. ------------------------------------------------------------------------

    async def _receive(self) -> None:
        while True:
            frame = await self.inbox.recv()
            if isinstance(frame, TextBatch):
                for delta in frame.deltas:
                    queue = self.streams.get(delta.rid)
                    if queue is not None:
                        queue.put_nowait(delta)
            elif isinstance(frame, EngineStatus):
                if frame.state != self.status.state:
                    log.info("engine_state", state=frame.state, detail=frame.detail)
                if self.status.boot and frame.boot != self.status.boot and self.streams:
                    log.error("scheduler_restarted", in_flight=len(self.streams))
                    self._fail(Error(rid="", status=503, message="the scheduler restarted and lost this request; retry it"))
                self.status, self.status_seen = frame, time.monotonic()
            elif isinstance(frame, Error):
                self._fail(frame)
            elif frame is not None:
                log.warning("unexpected_frame", frame=type(frame).__name__)
                FRAMES_UNEXPECTED.labels(self.inbox.name).inc()

    def _fail(self, error: Error) -> None:
        exc = ApiError(error.status, error.message, headers={"Retry-After": "1"} if error.status in (429, 503) else None)
        targets = list(self.streams) if not error.rid else [error.rid]
        for rid in targets:
            queue = self.streams.get(rid)
            if queue is not None:
                queue.put_nowait(exc)

    async def _watch(self) -> None:
        """Fails every in-flight request when the engine goes silent: a hang must never look alive."""
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            if self.status_seen and not self.connected and self.streams:
                log.error("engine_lost", in_flight=len(self.streams))
                self._fail(Error(rid="", status=503, message="the engine stopped responding"))
