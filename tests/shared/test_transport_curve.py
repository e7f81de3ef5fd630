"""Binding outside loopback needs CURVE keys; with them, only a peer holding the stack's secret key gets frames in."""

from __future__ import annotations

import socket

import pytest
import zmq
import zmq.auth

from shared.frames import Abort
from shared.transport import Curve, Inbox, InsecureBindError, Outbox, is_local_address, stop_authenticator


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def curve(tmp_path) -> Curve:
    _, secret_file = zmq.auth.create_certificates(str(tmp_path), "stack")
    return Curve.load(secret_file)


def _received(inbox: Inbox, wait_s: float) -> list:
    frames = []
    for _ in range(int(wait_s * 10)):
        frames += list(inbox.recv(100))
        if frames:
            break
    return frames


def test_addresses_that_stay_on_this_host() -> None:
    assert all(is_local_address(a) for a in ("ipc:///tmp/x.sock", "inproc://x", "tcp://127.0.0.1:5", "tcp://localhost:5", "tcp://[::1]:5"))
    assert not any(is_local_address(a) for a in ("tcp://0.0.0.0:5", "tcp://*:5", "tcp://10.1.2.3:5", "tcp://scheduler:5551", "tcp://eth0:5"))


def test_binding_all_interfaces_without_keys_is_refused() -> None:
    ctx = zmq.Context()
    with pytest.raises(InsecureBindError, match="CURVE keys"):
        Inbox(ctx, f"tcp://0.0.0.0:{_free_port()}", "open_inbox")
    ctx.term()


def test_a_certificate_without_its_secret_key_is_refused(tmp_path) -> None:
    public_file, _ = zmq.auth.create_certificates(str(tmp_path), "stack")
    with pytest.raises(ValueError, match="no secret key"):
        Curve.load(public_file)


def test_only_a_peer_with_the_stack_key_is_served(curve: Curve, tmp_path) -> None:
    ctx = zmq.Context()
    port = _free_port()
    inbox = Inbox(ctx, f"tcp://0.0.0.0:{port}", "curve_inbox", curve)
    address = f"tcp://127.0.0.1:{port}"
    # No CURVE at all, and CURVE with the server's public key but a key pair of its own: both refused.
    plain = Outbox(ctx, address, "plain_outbox")
    stranger_public, stranger_secret = zmq.curve_keypair()
    stranger = Outbox(ctx, address, "stranger_outbox", Curve(stranger_public, stranger_secret))
    stranger.socket.curve_serverkey = curve.public
    plain.send(Abort(rid="plain"))
    stranger.send(Abort(rid="stranger"))
    assert _received(inbox, 1.5) == []
    member = Outbox(ctx, address, "member_outbox", curve)
    member.send(Abort(rid="member"))
    assert _received(inbox, 5.0) == [Abort(rid="member")]
    assert _received(inbox, 0.5) == []  # the refused frames never arrive later either
    for box in (plain, stranger, member, inbox):
        box.close()
    stop_authenticator(ctx)
    ctx.term()
