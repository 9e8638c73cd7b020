"""Sinks read back: TensorBoard event files (EventAccumulator), CSV, JSONL; the writer's queue."""
import csv
import json
import threading

import numpy as np
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from examples.tiny_gpt import TinyGPT, synthetic_batches
from msprobe_engine.sinks import BackgroundWriter
from msprobe_integrations.torch import TorchMonitor
from tests.sink_helpers import EVERY_TAG_TENSORBOARD


def run_monitored(tmp_path, steps=3, tensorboard=EVERY_TAG_TENSORBOARD):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = TorchMonitor(model, opt, {"output_dir": str(tmp_path), "strict": True,
                                        "sinks": [tensorboard, "csv", "jsonl"],
                                        "watch": {"activation_grads": True}})
    reference = []
    for tokens, targets in synthetic_batches(model.cfg, steps):
        loss = model(tokens, targets)
        opt.zero_grad()
        loss.backward()
        reference.append({"loss": loss.item(), "fc1_grad_norm": model.layers[0].mlp[0].weight.grad.norm().item(),
                          "head_grad_max": model.head.weight.grad.max().item()})
        opt.step()
        monitor.step_end(loss)
    monitor.close()
    return monitor, reference


def test_tensorboard_events_read_back_with_tags_steps_and_values(tmp_path):
    monitor, reference = run_monitored(tmp_path)
    acc = EventAccumulator(str(tmp_path / "rank0"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "grad/global/norm", "grad/layers.0.mlp.0.weight/norm",
            "actv/layers.0.mlp.0/output/max", "actv_grad/layers.1.attn/output.0/norm",
            "optim/head.weight/exp_avg/norm", "optim/head.weight/exp_avg_sq/mean"} <= tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [0, 1, 2]
    np.testing.assert_allclose([e.value for e in loss], [r["loss"] for r in reference], rtol=1e-6)
    np.testing.assert_allclose([e.value for e in acc.Scalars("grad/layers.0.mlp.0.weight/norm")],
                               [r["fc1_grad_norm"] for r in reference], rtol=1e-5)
    np.testing.assert_allclose([e.value for e in acc.Scalars("grad/head.weight/max")],
                               [r["head_grad_max"] for r in reference], rtol=1e-6)


def test_tensorboard_by_default_keeps_the_norms_of_activations_and_gradients(tmp_path):
    monitor, _ = run_monitored(tmp_path, steps=2, tensorboard="tensorboard")
    acc = EventAccumulator(str(tmp_path / "rank0"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    written = set(monitor.history[-1].metrics)  # every tag of the record (metrics.jsonl has them all)
    per_layer = {t for t in written if t.split("/")[0] in ("actv", "actv_grad", "grad", "param", "optim")}
    assert tags == (written - per_layer) | {t for t in per_layer if t.split("/")[0] in ("actv", "grad")
                                            and t.endswith("/norm")}


def test_csv_and_jsonl_hold_the_same_records(tmp_path):
    monitor, reference = run_monitored(tmp_path)
    with open(tmp_path / "rank0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    lines = [json.loads(line) for line in (tmp_path / "rank0" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and lines[0]["rank"] == 0 and lines[0]["micro_steps"] == 1
    from_csv = {(int(r["step"]), r["tag"]): float(r["value"]) for r in rows}
    for line in lines:
        for tag, value in line["metrics"].items():
            assert from_csv[(line["step"], tag)] == value


def test_full_queue_drops_and_counts_or_waits():
    gate = threading.Event()
    done = []
    writer = BackgroundWriter(queue_size=1, when_full="drop")
    writer.submit(gate.wait, "blocker")       # taken by the thread, which then blocks
    while writer._queue.unfinished_tasks and writer._queue.qsize():
        pass
    accepted = [writer.submit(lambda i=i: done.append(i), "record") for i in range(5)]
    gate.set()
    writer.close()
    assert accepted.count(True) >= 1 and writer.dropped == accepted.count(False) >= 3
    assert len(done) == accepted.count(True)

    waiting = BackgroundWriter(queue_size=1, when_full="wait")
    for i in range(20):
        waiting.submit(lambda i=i: done.append(i), "record")
    waiting.close()
    assert waiting.dropped == 0 and len(done) == accepted.count(True) + 20


def test_a_failing_write_is_reported_and_the_writer_goes_on(caplog):
    writer = BackgroundWriter(queue_size=4)
    done = []
    writer.submit(lambda: 1 / 0, "bad sink")
    writer.submit(lambda: done.append(1), "good sink")
    writer.flush()
    writer.close()
    assert done == [1] and writer.failed == 1
    assert any("bad sink failed: ZeroDivisionError" in r.message for r in caplog.records)


def test_csv_rows_are_what_csv_writer_writes_quotes_and_floats_included(tmp_path):
    """Fields and quoting as csv.writer's; each number reads back as the same value (its text is
    orjson's spelling, e.g. 0.00001 for 1e-05; nan and infinities as repr writes them)."""
    import io

    from msprobe_engine.records import StepRecord
    from msprobe_engine.sinks.csv_sink import CSV_NAME, CsvSink

    metrics = {"actv/a,b/output/norm": 1.5, 'grad/q"x/max': float("nan"), "optim/w/inf": float("inf"),
               "param/n/min": -0.0, "monitor/tensors": 3, "param/t/norm": 1e-300, "train/sp ace": 0.1 + 0.2,
               "train/small": 1e-05, "train/big": 1e22, "train/low": float("-inf")}
    sink = CsvSink(CsvSink.Config(name="csv"), tmp_path)
    sink.open()
    other = {**metrics, "train/flag": True, "train/np": np.float32(0.5)}  # other types: through csv.writer
    records = [(7, metrics), (8, metrics), (9, {}), (10, other), (11, dict(reversed(metrics.items())))]
    for step, values in records:
        sink.write(StepRecord(step=step, rank=0, micro_steps=1, metrics=values))
    sink.close()
    expected = io.StringIO()
    writer = csv.writer(expected)
    writer.writerow(["step", "tag", "value"])
    for step, values in records:
        writer.writerows((step, tag, value) for tag, value in values.items())
    text = (tmp_path / CSV_NAME).read_bytes().decode()
    got, want = list(csv.reader(io.StringIO(text))), list(csv.reader(io.StringIO(expected.getvalue())))
    assert [row[:2] for row in got] == [row[:2] for row in want]  # the steps, the tags' fields
    def numbers(rows: list[list[str]]) -> list[str]:
        return [repr(float(value)) for *_, value in rows[1:] if value != "True"]
    assert numbers(got) == numbers(want)
    assert text.count("\r\n") == len(want)  # csv.writer's line ends
    assert "7,train/small,0.00001\r\n" in text  # orjson's spelling (repr: 1e-05)
    assert '7,"grad/q""x/max",nan\r\n' in text and "7,train/low,-inf\r\n" in text  # as repr writes them


def _same_json(text: str | bytes) -> object:
    """`text` parsed, nan and infinities as strings (comparable)."""
    return json.loads(text, parse_constant=str)


def test_jsonl_lines_are_the_records_as_json():
    from msprobe_engine.records import AlertEvent, StepRecord
    from msprobe_engine.sinks.jsonl_sink import record_line

    metrics = {'actv/a"b\\c/output/norm': 1.5, "grad/é/max": float("nan"), "optim/w/inf": float("inf"),
               "param/n/min": float("-inf"), "param/z/min": -0.0, "monitor/tensors": 3, "param/t/norm": 1e-300,
               "train/x": 0.1 + 0.2, "train/big": 1e22}
    finite = {tag: v for tag, v in metrics.items() if v - v == 0}
    alert = AlertEvent("spike", "train/x", "start", 4, 9.5, threshold=2.0, also=("a", "b"))
    nan_alert = AlertEvent("non_finite", "grad/é/max", "start", 4, float("nan"))
    records = [StepRecord(4, 0, 2, metrics, [alert, nan_alert], 12.5), StepRecord(5, 1, 1, metrics, [], 13.0),
               StepRecord(6, 0, 1, {}, [], 0.0), StepRecord(7, 0, 1, {**metrics, "train/flag": True}),
               StepRecord(8, 0, 1, dict(reversed(metrics.items()))), StepRecord(9, 0, 1, finite),
               StepRecord(10, 0, 1, {**finite, "monitor/huge": 2 ** 70})]  # beyond orjson's ints: json's
    for record in records:
        line = record_line(record)
        assert _same_json(line) == _same_json(record.as_json())
        assert list(json.loads(line)["metrics"]) == list(record.metrics)  # the tags' order kept
    assert b'"param/z/min":-0.0' in record_line(records[0])  # orjson's line; the sign of a zero kept


def test_number_texts_read_back_as_the_same_numbers():
    from msprobe_engine.json_text import number_texts

    rng = np.random.default_rng(3)
    values = [float(v) for v in rng.standard_normal(500) * 10.0 ** rng.integers(-300, 300, 500)]
    values += [0.0, -0.0, 5e-324, 1.7976931348623157e308, 2 ** 53, -7, float("nan"), float("inf"), float("-inf")]
    texts = number_texts(values)
    assert len(texts) == len(values)
    assert [repr(float(t)) for t in texts] == [repr(float(v)) for v in values]
    assert texts[-3:] == [b"nan", b"inf", b"-inf"] and texts[-4] == b"-7"
    assert number_texts([]) == []
    assert number_texts([1.5, 2 ** 70]) == [b"1.5", str(2 ** 70).encode()]  # beyond orjson's ints: repr
