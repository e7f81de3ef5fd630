"""Encoding and decoding of frames. Bytes from a socket are untrusted: decoding fails loudly."""

from __future__ import annotations

import msgspec

from shared.frames import Frame


class FrameDecodeError(ValueError):
    """The bytes are not a valid tokenyard frame."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


def encode(frame: Frame) -> bytes:
    return _encoder.encode(frame)


def decode(data: bytes) -> Frame:
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameDecodeError(f"bad frame ({len(data)} bytes): {exc}") from exc
