"""Read an offline W&B run (`run-<id>.wandb`) back with W&B's own record schema.

wandb 0.31 has no Python reader for its transaction log any more (the Go `wandb-core` reads
it); the file is LevelDB log framing (32 KiB blocks, 7-byte record headers: crc, length,
type) after a 7-byte `:W&B` header, each record a `wandb_internal_pb2.Record`.
"""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7  # ":W&B", magic (2 bytes), version
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pos, chunk = [], HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if pos + length > len(data):  # the last record is still being written
            break
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left - 7
            continue
        chunk += data[pos:pos + length]
        pos += length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def finished_records(path: Path, patience_s: float = 60.0) -> list:
    """The records of a finished run's log: W&B's service process may still be writing it when
    `finish()` returns (seen after `log_artifact`; once a record read half-written, under load),
    so it is read again until its `exit` record."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + patience_s
    while True:
        try:
            records = read_records(path)
        except DecodeError:  # a record caught half-written (its block's framing ahead of its bytes)
            if time.monotonic() > deadline:
                raise
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def history(run_dir: Path) -> tuple[list[dict], object]:
    """(the logged rows: key -> value, with `_step`), and the run record (name, project, tags)
    of the one offline run under `run_dir`."""
    (path,) = Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")
    rows, run = [], None
    for record in finished_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif kind == "run":
            run = record.run
    return rows, run
