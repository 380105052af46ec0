"""TensorBoard's event file format, for scalars: what ``TensorBoardLogger`` writes, with no
dependency.

An event file is a sequence of TFRecords: ``uint64 length, uint32 masked CRC-32C of those 8
bytes, the data, uint32 masked CRC-32C of the data`` (little-endian). Each record's data is one
``tensorboard.Event`` protocol buffer; the ones a scalar logger needs are a few fields, encoded
here by hand (field numbers from TensorBoard's ``event.proto`` and ``summary.proto``):

    Event       wall_time: double = 1, step: int64 = 2, file_version: string = 3,
                summary: Summary = 5, session_log: SessionLog = 7
    Summary     value: repeated Value = 1;   Value: tag: string = 1, simple_value: float = 2
    SessionLog  status: enum = 1 (START = 1)

Writing them directly, rather than through tensorboardX, keeps ``import torch`` out of every
start: tensorboardX's package imports torch when it is installed (seconds on a GPU machine).
"""
from __future__ import annotations

import struct


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)  # Castagnoli, reflected
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``, as TFRecord checksums use."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc(header)) + data + struct.pack("<I", masked_crc(data))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): a string or a nested message."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int, *, file_version: str | None = None,
          scalars: dict[str, float] | None = None, session_start: bool = False) -> bytes:
    """One ``Event`` message: a file's version header, a restart mark, or scalars at ``step``."""
    if step < 0:
        raise ValueError(f"step={step}: TensorBoard steps are not negative.")
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _field(3, file_version.encode())
    if scalars:
        values = b"".join(_field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
                          for tag, value in scalars.items())
        out += _field(5, values)
    if session_start:
        out += _field(7, b"\x08\x01")
    return out
