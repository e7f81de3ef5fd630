"""ZeroMQ transport: each process binds one PULL inbox and connects PUSH outboxes to its peers.

PUSH/PULL keeps frames in order per sender, which the pipelined step protocol relies on
(a worker runs plans in the order the scheduler sent them). A frame that fails to
decode is logged and counted, and the receiving loop carries on.

An inbox binds to loopback or ipc unless the stack has a CURVE certificate
(``--curve-key-file``): then every socket speaks CURVE with the stack's one key pair,
each inbox (the CURVE server) lets in only clients that present that same key, and a
peer without the secret key never gets a frame through.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
from collections.abc import Callable, Iterator
from typing import NamedTuple

import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from shared.codec import FrameDecodeError, decode, encode
from shared.frames import Frame
from shared.metrics import FRAME_COUNTS, FRAME_DECODE_ERRORS

_HWM = 100_000  # frames queued per socket before a send would block
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: pyzmq's enum arithmetic costs microseconds per frame

log = structlog.get_logger()


class InsecureBindError(RuntimeError):
    """An inbox asked to bind outside loopback / ipc without CURVE keys."""


class Curve(NamedTuple):
    """The stack's CURVE key pair (z85): every inbox serves with it and every outbox presents it."""

    public: bytes
    secret: bytes

    @classmethod
    def load(cls, path: str) -> Curve:
        """From a certificate written by ``zmq.auth.create_certificates`` (the ``.key_secret`` file)."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"CURVE certificate {path!r} does not exist")
        public, secret = zmq.auth.load_certificate(path)
        if not secret:
            raise ValueError(f"CURVE certificate {path!r} has no secret key: pass the .key_secret file")
        return cls(public, secret)

    @classmethod
    def from_file(cls, path: str) -> Curve | None:
        """``--curve-key-file``: None when unset (loopback and ipc only)."""
        return cls.load(path) if path else None


_authenticators: dict[int, ThreadAuthenticator] = {}  # per zmq context: one ZAP handler each


def _authenticate(ctx: zmq.Context, curve: Curve) -> None:
    """Starts the context's ZAP handler, which admits a CURVE client only if it presents the stack's public key."""
    if id(ctx) in _authenticators:
        return

    class StackKeyOnly:
        def callback(self, domain: str, client_key: bytes) -> bool:
            allowed = client_key == curve.public
            if not allowed:
                log.warning("curve_client_refused", client_key=client_key.decode(errors="replace"))
            return allowed

    authenticator = ThreadAuthenticator(ctx)
    authenticator.start()
    authenticator.configure_curve_callback("*", credentials_provider=StackKeyOnly())
    _authenticators[id(ctx)] = authenticator


def stop_authenticator(ctx: zmq.Context) -> None:
    authenticator = _authenticators.pop(id(ctx), None)
    if authenticator is not None:
        authenticator.stop()


def is_local_address(address: str) -> bool:
    """ipc, inproc, or tcp on a loopback host: reachable from this host only."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, an interface name or "*": not provably local
        return False


def _secure_server(socket: zmq.Socket, ctx: zmq.Context, address: str, curve: Curve | None) -> None:
    if curve is None:
        check_binds([address], "")
        return
    _authenticate(ctx, curve)
    socket.curve_secretkey = curve.secret
    socket.curve_publickey = curve.public
    socket.curve_server = True


def _secure_client(socket: zmq.Socket, curve: Curve | None) -> None:
    if curve is not None:
        socket.curve_serverkey = curve.public
        socket.curve_publickey = curve.public
        socket.curve_secretkey = curve.secret


def _prepare_bind(address: str) -> None:
    if address.startswith("ipc://"):
        path = address[len("ipc://") :]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path):  # a stale socket file of a previous run
            os.unlink(path)


class _Receiver:
    """Decoding and accounting shared by the blocking and event-loop inboxes."""

    def __init__(self, ctx: zmq.Context, address: str, name: str, curve: Curve | None = None) -> None:
        _prepare_bind(address)
        self.name = name
        self.address = address
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVHWM, _HWM)
        self.socket.setsockopt(zmq.LINGER, 0)
        _secure_server(self.socket, ctx, address, curve)
        self.socket.bind(address)
        self._counts = FRAME_COUNTS.pair(name, "received")  # [frames, bytes], added to per frame
        self._decode_errors = FRAME_DECODE_ERRORS.labels(name)

    def _decode(self, data: bytes) -> Frame | None:
        counts = self._counts
        counts[0] += 1
        counts[1] += len(data)
        try:
            return decode(data)
        except FrameDecodeError as exc:
            self._decode_errors.inc()
            log.error("frame_decode_error", socket=self.name, error=str(exc))
            return None

    def _queued(self) -> Iterator[Frame]:
        """Every frame already queued, read without blocking.

        Each read that finds nothing (zmq.Again), and each ZMQ_EVENTS query, processes ZeroMQ's pending
        commands, which re-arms an edge-signalling ZMQ_FD. A wake-up mostly brings one frame: read it
        first, then ask ZMQ_EVENTS whether another is there (two calls into ZeroMQ for one frame, each
        with system calls, rather than a query before every read and one after the last).
        """
        socket = self.socket
        try:
            data = socket.recv(zmq.NOBLOCK)
        except zmq.Again:  # a wake-up for ZeroMQ's own commands, or an edge already drained
            return
        while True:
            frame = self._decode(data)
            if frame is not None:
                yield frame
            if not socket.getsockopt(_EVENTS) & _POLLIN:
                return
            data = socket.recv(zmq.NOBLOCK)

    def close(self) -> None:
        self.socket.close(0)


class Inbox(_Receiver):
    """A blocking inbox, for the processes whose loop is a plain ``while``."""

    def recv(self, timeout_ms: int) -> Iterator[Frame]:
        """Waits up to timeout_ms for a frame, then yields every frame already queued."""
        if self.socket.poll(timeout_ms):
            yield from self._queued()


class AsyncInbox(_Receiver):
    """An inbox read from an asyncio loop: ``start(on_frame)`` calls ``on_frame`` with each frame as it arrives.

    A plain socket whose file descriptor the loop watches: when it signals, every queued frame is
    read without blocking. (zmq.asyncio's per-message futures cost more than the frame itself.)
    The descriptor signals edges, so each wake-up reads until ZMQ says nothing is left.
    """

    def __init__(self, ctx: zmq.Context, address: str, name: str, curve: Curve | None = None) -> None:
        super().__init__(ctx, address, name, curve)
        self._on_frame: Callable[[Frame], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, on_frame: Callable[[Frame], None]) -> None:
        self._on_frame, self._loop = on_frame, asyncio.get_running_loop()
        self._loop.add_reader(self.socket.getsockopt(zmq.FD), self._drain)
        self._loop.call_soon(self._drain)  # frames that arrived before the reader was added raised no edge

    def _drain(self) -> None:
        for frame in self._queued():
            try:
                self._on_frame(frame)
            except Exception:  # one bad frame must not stop the inbox: the edge is consumed, no second call comes
                log.exception("frame_handler_failed", socket=self.name, frame=type(frame).__name__)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.socket.getsockopt(zmq.FD))
        super().close()


class Outbox:
    def __init__(self, ctx: zmq.Context, address: str, name: str, curve: Curve | None = None) -> None:
        self.name = name
        self.address = address
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.SNDHWM, _HWM)
        self.socket.setsockopt(zmq.LINGER, 0)
        _secure_client(self.socket, curve)
        self.socket.connect(address)
        self._counts = FRAME_COUNTS.pair(name, "sent")

    def send(self, frame: Frame) -> None:
        data = encode(frame)
        self.socket.send(data, zmq.NOBLOCK)
        counts = self._counts
        counts[0] += 1
        counts[1] += len(data)

    def close(self) -> None:
        self.socket.close(0)


class ReplyOutboxes:
    """PUSH outboxes to the api replicas that own requests, opened on first use by address.

    ``address == ""`` means the configured default api. A request's ``reply_to`` comes from a
    frame, so an address that is not a ZMQ endpoint is refused (None) rather than raised, and
    at most ``max_open`` outboxes stay open (the least recently used one is closed first).
    """

    _SCHEMES = ("ipc://", "tcp://", "inproc://")

    def __init__(self, ctx: zmq.Context, default_address: str, name: str, curve: Curve | None = None, max_open: int = 64) -> None:
        self.ctx, self.name, self.max_open, self.curve = ctx, name, max_open, curve
        self.default = Outbox(ctx, default_address, name, curve)
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
                outbox = Outbox(self.ctx, address, self.name, self.curve)
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


def check_binds(addresses: list[str], curve_key_file: str) -> None:
    """Raises InsecureBindError, before anything starts, if an address outside loopback / ipc would bind without CURVE."""
    exposed = [address for address in addresses if not is_local_address(address)]
    if exposed and not curve_key_file:
        raise InsecureBindError(
            f"refusing to bind {', '.join(exposed)}: an address outside loopback or ipc needs CURVE keys "
            "(create them with `python -m shared.transport keys DIR` and pass --curve-key-file DIR/stack.key_secret)"
        )


def create_keys(directory: str) -> str:
    """The stack's certificate in ``directory`` (``stack.key`` and ``stack.key_secret``), made once and then kept."""
    secret_file = os.path.join(directory, "stack.key_secret")
    if not os.path.isfile(secret_file):
        os.makedirs(directory, exist_ok=True)
        _, secret_file = zmq.auth.create_certificates(directory, "stack")
        os.chmod(secret_file, 0o600)
    Curve.load(secret_file)  # a readable certificate with its secret key, or a clear error
    return secret_file


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "keys":
        sys.exit("usage: python -m shared.transport keys DIR   (writes DIR/stack.key and DIR/stack.key_secret)")
    print(create_keys(sys.argv[2]))
