"""ZeroMQ transport: each process binds one PULL inbox and connects PUSH outboxes to its peers.

PUSH/PULL keeps frames in order per sender, which the pipelined step protocol relies on
(a worker runs plans in the order the scheduler sent them). A frame that fails to
decode is logged and counted, and the receiving loop carries on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import structlog
import zmq
import zmq.asyncio

from shared.codec import FrameDecodeError, decode, encode
from shared.frames import Frame
from shared.metrics import FRAME_BYTES, FRAME_DECODE_ERRORS, FRAMES

_HWM = 100_000  # frames queued per socket before a send would block

log = structlog.get_logger()


def _prepare_bind(address: str) -> None:
    if address.startswith("ipc://"):
        path = address[len("ipc://") :]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path):  # a stale socket file of a previous run
            os.unlink(path)


class _Receiver:
    """Decoding and accounting shared by the sync and asyncio inboxes."""

    name: str

    def _decode(self, data: bytes) -> Frame | None:
        FRAMES.labels(self.name, "received").inc()
        FRAME_BYTES.labels(self.name, "received").inc(len(data))
        try:
            return decode(data)
        except FrameDecodeError as exc:
            FRAME_DECODE_ERRORS.labels(self.name).inc()
            log.error("frame_decode_error", socket=self.name, error=str(exc))
            return None


class Inbox(_Receiver):
    def __init__(self, ctx: zmq.Context, address: str, name: str) -> None:
        _prepare_bind(address)
        self.name = name
        self.address = address
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVHWM, _HWM)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)

    def recv(self, timeout_ms: int) -> Iterator[Frame]:
        """Waits up to timeout_ms for a frame, then yields every frame already queued."""
        if not self.socket.poll(timeout_ms):
            return
        while True:
            try:
                data = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            frame = self._decode(data)
            if frame is not None:
                yield frame

    def close(self) -> None:
        self.socket.close(0)


class AsyncInbox(_Receiver):
    def __init__(self, ctx: zmq.asyncio.Context, address: str, name: str) -> None:
        _prepare_bind(address)
        self.name = name
        self.address = address
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVHWM, _HWM)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)

    async def recv(self) -> Frame | None:
        """The next frame; None for one that failed to decode."""
        return self._decode(await self.socket.recv())

    def close(self) -> None:
        self.socket.close(0)


class Outbox:
    def __init__(self, ctx: zmq.Context, address: str, name: str) -> None:
        self.name = name
        self.address = address
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.SNDHWM, _HWM)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def send(self, frame: Frame) -> None:
        data = encode(frame)
        self.socket.send(data, zmq.NOBLOCK)
        FRAMES.labels(self.name, "sent").inc()
        FRAME_BYTES.labels(self.name, "sent").inc(len(data))

    def close(self) -> None:
        self.socket.close(0)


class ReplyOutboxes:
    """PUSH outboxes to the api replicas that own requests, opened on first use by address.

    ``address == ""`` means the configured default api. A request's ``reply_to`` comes from a
    frame, so an address that is not a ZMQ endpoint is refused (None) rather than raised, and
    at most ``max_open`` outboxes stay open (the least recently used one is closed first).
    """

    _SCHEMES = ("ipc://", "tcp://", "inproc://")

    def __init__(self, ctx: zmq.Context, default_address: str, name: str, max_open: int = 64) -> None:
        self.ctx, self.name, self.max_open = ctx, name, max_open
        self.default = Outbox(ctx, default_address, name)
        self._open: dict[str, Outbox] = {default_address: self.default}

    def get(self, address: str) -> Outbox | None:
        if not address:
            return self.default
        outbox = self._open.pop(address, None)
        if outbox is None:
            if not address.startswith(self._SCHEMES):
                log.warning("bad_reply_address", socket=self.name, address=address[:200])
                return None
            try:
                outbox = Outbox(self.ctx, address, self.name)
            except zmq.ZMQError as exc:
                log.warning("bad_reply_address", socket=self.name, address=address[:200], error=str(exc))
                return None
            while len(self._open) >= self.max_open:
                oldest = next(a for a in self._open if self._open[a] is not self.default)
                self._open.pop(oldest).close()
        self._open[address] = outbox  # most recently used last
        return outbox

    def send(self, address: str, frame: Frame) -> None:
        outbox = self.get(address)
        if outbox is not None:
            outbox.send(frame)

    def close(self) -> None:
        for outbox in self._open.values():
            outbox.close()
        self._open.clear()
