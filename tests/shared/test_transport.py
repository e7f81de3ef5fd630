"""The inboxes survive garbage: they log and count the bad frame and deliver the next good one."""

from __future__ import annotations

import asyncio

import zmq

from shared.frames import Abort
from shared.metrics import FRAME_DECODE_ERRORS
from shared.transport import AsyncInbox, Inbox, Outbox


def _sockets(tmp_path, inbox_type: type[Inbox] | type[AsyncInbox], name: str) -> tuple[zmq.Context, Inbox | AsyncInbox, zmq.Socket, Outbox]:
    """An inbox of ``inbox_type`` named ``name``, a raw PUSH socket (for garbage) and an outbox, both sending to it."""
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/inbox.sock"
    inbox = inbox_type(ctx, address, name)
    raw = ctx.socket(zmq.PUSH)
    raw.connect(address)
    return ctx, inbox, raw, Outbox(ctx, address, f"{name}_outbox")


def test_garbage_frame_is_counted_and_skipped(tmp_path) -> None:
    ctx, inbox, raw, outbox = _sockets(tmp_path, Inbox, "test_inbox")
    before = FRAME_DECODE_ERRORS.labels("test_inbox")._value.get()
    raw.send(b"\xc1 definitely not msgpack")
    outbox.send(Abort(rid="r1"))
    received = []
    for _ in range(20):  # two senders: the frames may arrive in either order
        received += list(inbox.recv(100))
        if received and FRAME_DECODE_ERRORS.labels("test_inbox")._value.get() > before:
            break
    assert received == [Abort(rid="r1")]
    assert FRAME_DECODE_ERRORS.labels("test_inbox")._value.get() == before + 1
    for s in (raw, outbox, inbox):
        s.close()
    ctx.term()


async def test_the_event_loop_inbox_delivers_early_frames_and_outlives_bad_ones(tmp_path) -> None:
    """Frames queued before ``start`` arrive (they raised no edge); a garbage frame is counted and a
    handler that raises is logged, and neither stops the frames after them."""
    ctx, inbox, raw, outbox = _sockets(tmp_path, AsyncInbox, "test_async_inbox")
    errors_before = FRAME_DECODE_ERRORS.labels("test_async_inbox")._value.get()
    outbox.send(Abort(rid="early"))
    await asyncio.sleep(0.2)  # queued in the inbox before anyone reads it
    received: list = []

    def on_frame(frame) -> None:
        received.append(frame)
        if frame.rid == "raises":
            raise RuntimeError("a handler bug")

    inbox.start(on_frame)
    raw.send(b"\xc1 definitely not msgpack")
    for rid in ("raises", "after"):
        outbox.send(Abort(rid=rid))
    for _ in range(50):
        if len(received) == 3:
            break
        await asyncio.sleep(0.05)
    assert [f.rid for f in received] == ["early", "raises", "after"]
    assert FRAME_DECODE_ERRORS.labels("test_async_inbox")._value.get() == errors_before + 1
    for _ in range(3):  # later bursts still wake the loop
        outbox.send(Abort(rid="later"))
    for _ in range(50):
        if len(received) == 6:
            break
        await asyncio.sleep(0.05)
    assert [f.rid for f in received[3:]] == ["later"] * 3
    for s in (raw, outbox, inbox):
        s.close()
    ctx.term()
