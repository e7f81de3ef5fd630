"""The inbox survives garbage: it logs and counts the bad frame and delivers the next good one."""

from __future__ import annotations

import zmq

from shared.frames import Abort
from shared.metrics import FRAME_DECODE_ERRORS
from shared.transport import Inbox, Outbox


def test_garbage_frame_is_counted_and_skipped(tmp_path) -> None:
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/inbox.sock"
    inbox = Inbox(ctx, address, "test_inbox")
    raw = ctx.socket(zmq.PUSH)
    raw.connect(address)
    outbox = Outbox(ctx, address, "test_outbox")
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
