"""TensorBoard scalars without the tensorboard package: an events file of scalar summaries.

The file is what TensorBoard's event reader expects: TFRecords (length, masked CRC-32C of the length,
the bytes, masked CRC-32C of the bytes) holding `Event` protobufs (wall_time = 1, step = 2,
file_version = 3, summary = 5 -> Summary.value = 1 -> Value {tag = 1, simple_value = 2}), encoded here
by hand: the only messages needed are these few fields.
"""

from __future__ import annotations

import os
import socket
import struct
import time

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected
_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ _POLY if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> bytes:
    crc = crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def record(data: bytes) -> bytes:
    """One TFRecord around `data`."""
    length = struct.pack("<Q", len(data))
    return length + _masked(length) + data + _masked(data)


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1
    while True:
        bits, value = value & 0x7F, value >> 7
        out.append(bits | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + payload


def _length_delimited(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def event(
    wall_time: float, step: int, scalars: dict[str, float] | None = None, file_version: str | None = None
) -> bytes:
    """An Event protobuf: a file version header, or scalar summaries at `step`."""
    out = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
    if file_version is not None:
        out += _length_delimited(3, file_version.encode())
    if scalars:
        values = b"".join(
            _length_delimited(1, _length_delimited(1, tag.encode()) + _field(2, 5, struct.pack("<f", value)))
            for tag, value in scalars.items()
        )
        out += _length_delimited(5, values)
    return out


class EventWriter:
    """Appends scalar events to `directory/events.out.tfevents.<time>.<host>.<suffix>`."""

    def __init__(self, directory: str, suffix: str):
        os.makedirs(directory, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{suffix}"
        self._file = open(os.path.join(directory, name), "ab")
        self._file.write(record(event(time.time(), 0, file_version="brain.Event:2")))
        self._file.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._file.write(record(event(time.time(), step, values)))
        self._file.flush()
