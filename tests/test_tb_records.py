"""The TensorBoard sink's own TFRecord framing (C CRC32C), against tensorboard's writer and reader."""
from __future__ import annotations

import io
import random

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow
from tensorboard.summary.writer.record_writer import RecordWriter

from msprobe_engine.sinks.tb_records import FILE_VERSION, EventFile, frame, masked_crc32c


def _records(path):
    """Every record of `path` through tensorboard's own reader, which checks both crcs."""
    reader = pywrap_tensorflow.PyRecordReader_New(str(path))
    out = []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return out
        out.append(reader.record())


@pytest.mark.parametrize("data", [b"", b"x", bytes(range(256)) * 37, random.Random(0).randbytes(100_000)])
def test_frames_are_byte_identical_to_tensorboards_record_writer(data):
    buffer = io.BytesIO()
    RecordWriter(buffer).write(data)
    assert frame(data) == buffer.getvalue()
    assert masked_crc32c(data) == pywrap_tensorflow.masked_crc32c(data)


def test_event_file_reads_back_through_tensorboards_loader_with_its_crc_checks(tmp_path):
    events = EventFile(tmp_path / "tb")
    tags = [f"grad/layers.{i}.weight/norm" for i in range(2500)]
    for step in range(3):
        values = [Summary.Value(tag=tag, simple_value=step + i / 7) for i, tag in enumerate(tags)]
        events.add_event(Event(step=step, wall_time=1.0 + step, summary=Summary(value=values)))
    events.close()
    (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    assert path == events.path
    raw = _records(path)  # raises DataLossError on a crc mismatch
    assert len(raw) == 4
    loaded = list(EventFileLoader(str(path)).Load())
    assert loaded[0].file_version == FILE_VERSION
    assert [e.step for e in loaded[1:]] == [0, 1, 2]
    assert [v.tag for v in loaded[-1].summary.value] == tags
    last = Event.FromString(raw[-1]).summary.value
    assert last[7].simple_value == pytest.approx(2 + 1.0)


@pytest.mark.parametrize("where", ["header", "data"])
def test_a_corrupted_record_fails_tensorboards_crc_check(tmp_path, where):
    events = EventFile(tmp_path)
    events.add_event(Event(step=1, summary=Summary(value=[Summary.Value(tag="a", simple_value=1.0)])))
    events.close()
    blob = bytearray(events.path.read_bytes())
    first = 8 + 4 + int.from_bytes(blob[:8], "little") + 4  # past the file-version record
    offset = first + (2 if where == "header" else 12 + 1)
    blob[offset] ^= 0xFF
    events.path.write_bytes(bytes(blob))
    with pytest.raises(errors.DataLossError, match="crc32"):
        _records(events.path)


def test_scalar_blocks_are_the_bytes_protobuf_writes_and_join_other_values(tmp_path):
    from tensorboard.compat.proto.summary_pb2 import Summary as S

    from msprobe_engine.sinks.tb_records import ScalarBlock

    tags = ["grad/layers.0.weight/norm", "train/loss", "actv/é/output/max", "x" * 300, "Health/grad_norm"]
    values = [1.5, float("nan"), float("-inf"), -0.0, 1e300]  # 1e300: beyond float32, stored as inf
    text = S.Value(tag="Health/incident")
    text.tensor.string_val.append(b"markdown")
    block = ScalarBlock(tags).encode(np.array(values))
    expected = Event(step=3, wall_time=2.5, summary=S(value=[S.Value(tag=t, simple_value=v) for t, v in
                                                             zip(tags, values)] + [text])).SerializeToString()
    events = EventFile(tmp_path)
    events.add_event(Event(step=3, wall_time=2.5), block + S(value=[text]).SerializeToString())
    events.close()
    assert _records(events.path)[1] == expected
    assert ScalarBlock([]).encode(np.zeros(0)) == b""
