"""Built-in metric loggers: ``jsonl`` (``metrics.jsonl``) and ``tensorboard`` (event files).

The TensorBoard writer is the event-file format itself (TFRecord framing of ``Event`` protos
with one scalar each), about thirty lines, so redco needs neither TensorFlow nor tensorboard.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import time

from redco.plugins import hookimpl


class JsonlLogger:
    def __init__(self, workdir: str):
        self._file = open(os.path.join(workdir, "metrics.jsonl"), "a")

    def log(self, step: int, metrics: dict) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        for _ in range(8):
            n = (n >> 1) ^ 0x82F63B78 if n & 1 else n >> 1
        table.append(n)
    return table


_CRC_TABLE = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:  # a length-delimited protobuf field
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


class TensorBoardLogger:
    def __init__(self, workdir: str):
        logdir = os.path.join(workdir, "tensorboard")
        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self._file = open(os.path.join(logdir, name), "ab")
        self._write_event(0, _field(3, b"brain.Event:2"))  # file_version

    def _write_event(self, step: int, body: bytes) -> None:
        event = b"\x09" + struct.pack("<d", time.time()) + b"\x10" + _varint(step) + body
        header = struct.pack("<Q", len(event))
        self._file.write(header + struct.pack("<I", _masked_crc32c(header)) + event
                         + struct.pack("<I", _masked_crc32c(event)))

    def log(self, step: int, metrics: dict) -> None:
        values = b"".join(
            _field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
            for tag, value in metrics.items())
        self._write_event(step, _field(5, values))  # Event.summary = Summary(value=[...])
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@hookimpl(trylast=True)
def register_loggers(register):
    register("jsonl", JsonlLogger)
    register("tensorboard", TensorBoardLogger)
