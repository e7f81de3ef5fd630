"""The api's gate in front of the engine: a bound on engine requests in flight, and the drain on shutdown.

Invariant: ``in_flight`` counts the engine requests of every admitted HTTP request until
its answer has ended. Past ``limit`` a new request gets 429 with ``Retry-After``; once
draining, 503. A drain waits for the admitted requests, then interrupts the rest with an
error that their handlers send to the client (a status before the first byte, an error
event after it), which also aborts their engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator

import structlog

from services.api.errors import ApiError

log = structlog.get_logger()

RETRY_AFTER_S = 1
_DRAIN_ABORT_GRACE_S = 5.0  # after the deadline, for interrupted handlers to write their error


class Ticket:
    """One admitted HTTP request: its engine request count, and how the gate interrupts it.

    Whoever runs its engine requests sets ``on_interrupt`` (which fails them with the error); an interrupt
    that comes before that is kept in ``error``, for them to raise when they start.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self.error: ApiError | None = None
        self.on_interrupt: Callable[[ApiError], None] | None = None

    def interrupt(self, error: ApiError) -> None:
        self.error = error
        if self.on_interrupt is not None:
            self.on_interrupt(error)


class Admission:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self.draining = False
        self.tickets: set[Ticket] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def admit(self, count: int) -> Iterator[Ticket]:
        """Holds ``count`` engine requests for the body of the ``with``; raises 503 while draining, 429 when full."""
        if self.draining:
            raise ApiError(503, "the server is shutting down and accepts no new requests", code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.in_flight >= self.limit:  # one request may overshoot by its n - 1: a large n alone is still served
            raise ApiError(
                429,
                f"too many requests in flight ({self.in_flight} engine requests, limit {self.limit}); retry later",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        ticket = Ticket(count)
        self.tickets.add(ticket)
        self.in_flight += count
        self._idle.clear()
        try:
            yield ticket
        finally:
            self.tickets.discard(ticket)
            self.in_flight -= count
            if not self.tickets:
                self._idle.set()

    async def drain(self, timeout_s: float) -> int:
        """Closes admission, waits up to ``timeout_s`` for the admitted requests, then interrupts the rest; returns how many."""
        self.draining = True
        started = time.monotonic()
        log.info("drain_started", in_flight=self.in_flight, timeout_s=timeout_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        interrupted = len(self.tickets)
        if interrupted:
            error = ApiError(503, f"the server shut down before this request finished (drain deadline of {timeout_s:g}s)", code="shutting_down")
            for ticket in list(self.tickets):
                ticket.interrupt(error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), _DRAIN_ABORT_GRACE_S)
        log.info("drain_finished", interrupted=interrupted, seconds=round(time.monotonic() - started, 2))
        return interrupted
