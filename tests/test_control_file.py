"""The live control file: schedule, rules and watched kinds switched while training, read at
step boundaries at most every `control.interval_s` seconds, a bad file reported and ignored."""
import json
import logging

import pytest
import torch

from health_models import Teacher, build
from msprobe_engine.monitor import Monitor

LOSS_SPIKE = [1.0, 1.1, 0.9, 1.0, 1.05, 50.0, 1.0]


def make(tmp_path, interval_s=0.0, **extra):
    config = {"output_dir": str(tmp_path), "sinks": [], "incidents": {"enabled": False},
              "alerts": [{"rule": "spike", "metrics": ["train/loss"], "warmup": 3}],
              "control": {"interval_s": interval_s}, **extra}
    return Monitor(config)


def write(tmp_path, data) -> None:
    (tmp_path / "control.json").write_text(data if isinstance(data, str) else json.dumps(data))


def take_effect(monitor, loss=1.0) -> None:
    """One step looks at the file (on the writer thread), the next step boundary applies it.
    (A look still in flight from an earlier step may have read the file before it changed:
    wait for it first, so that this step's look reads the file as it is now.)"""
    monitor.writer.flush()
    monitor.step_end(loss)
    monitor.writer.flush()
    monitor.step_end(loss)


def test_rules_are_switched_off_and_on_again(tmp_path):
    monitor = make(tmp_path)
    write(tmp_path, {"rules": {"spike": False}})
    take_effect(monitor)
    for loss in LOSS_SPIKE:
        monitor.step_end(loss)
    assert list(monitor.alert_log) == []
    write(tmp_path, {"rules": {"spike": True}})
    take_effect(monitor)
    for loss in LOSS_SPIKE:
        monitor.step_end(loss)
    monitor.close()
    assert [(e.rule, e.phase) for e in monitor.alert_log] == [("spike", "start"), ("spike", "end")]


def test_the_schedule_changes_and_removing_the_file_restores_the_config(tmp_path):
    monitor = make(tmp_path)
    write(tmp_path, {"schedule": {"interval": 3}})
    take_effect(monitor)
    start = monitor.step
    records = [monitor.step_end(1.0) for _ in range(6)]
    assert [r is not None for r in records] == [(start + i) % 3 == 0 for i in range(6)]
    (tmp_path / "control.json").unlink()
    take_effect(monitor)
    assert all(monitor.step_end(1.0) is not None for _ in range(3))
    monitor.close()


def test_watched_kinds_are_muted_and_unmuted(tmp_path):
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = make(tmp_path, watch={"params": True}).attach(model, optimizer)
    teacher = Teacher()

    def step():
        x, y = teacher.batch()
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return monitor.step_end(loss)

    def kinds(record):
        return {tag.split("/")[0] for tag in record.metrics}

    assert {"actv", "grad", "param", "optim"} <= kinds(step())
    write(tmp_path, {"watch": {"param_grads": False, "module_outputs": False}})
    step()
    monitor.writer.flush()
    step()
    muted = kinds(step())
    assert "actv" not in muted and "param" in muted and "optim" in muted
    assert not any(tag.startswith("grad/") and tag != "grad/global/norm" for tag in step().metrics)
    write(tmp_path, {"watch": {"param_grads": True}})
    step()
    monitor.writer.flush()
    step()
    assert {"actv", "grad", "param"} <= kinds(step())
    monitor.close()


@pytest.mark.parametrize("text, message", [
    ("{not json", "cannot read"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"rules": {"spiek": False}}), "rules.spiek: not one of spike"),
    (json.dumps({"schedule": {"interval": 0}, "mode": 1}), "schedule.interval: 0 is below the minimum 1"),
    (json.dumps({"watch": {"activation_grads": True}}), "watch.activation_grads: not watched since attach"),
])
def test_a_bad_file_is_reported_and_ignored(tmp_path, caplog, text, message):
    monitor = make(tmp_path)
    write(tmp_path, {"rules": {"spike": False}})
    take_effect(monitor)
    write(tmp_path, text)
    with caplog.at_level(logging.WARNING, logger="msprobe_engine"):
        take_effect(monitor)
    assert any(message in r.message and "ignored" in r.message for r in caplog.records), caplog.text
    for loss in LOSS_SPIKE:  # the settings in effect stay: spike is still off
        monitor.step_end(loss)
    monitor.close()
    assert list(monitor.alert_log) == []


def test_the_file_is_looked_at_no_more_often_than_the_interval(tmp_path):
    monitor = make(tmp_path, interval_s=3600.0)
    write(tmp_path, {"rules": {"spike": False}})
    for _ in range(3):
        take_effect(monitor)
    for loss in LOSS_SPIKE:
        monitor.step_end(loss)
    monitor.close()
    assert [e.phase for e in monitor.alert_log] == ["start", "end"]  # the file was not read yet


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "msprobe control" in r.getMessage()]


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory", "too_large"])
def test_a_control_file_that_is_not_a_small_regular_file_is_refused_without_blocking(tmp_path, caplog, kind):
    import os
    import time

    target = tmp_path / "control.json"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "dev_zero":
        target.symlink_to("/dev/zero")
    elif kind == "directory":
        target.mkdir()
    else:
        target.write_text(json.dumps({"rules": {}, "pad": "x" * (1 << 20)}))
    monitor = make(tmp_path)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="msprobe_engine"):
        for _ in range(4):
            take_effect(monitor)
        monitor.close()
    assert time.monotonic() - began < 10
    messages = _warnings(caplog)
    assert len(messages) == 1, messages  # reported once: the file did not change
    assert ("not a regular file" if kind != "too_large" else "larger than") in messages[0]


def test_an_unreadable_control_file_is_reported_once_until_it_changes(tmp_path, caplog):
    (tmp_path / "control.json").write_bytes(b'{"rules": {"spike": \xff}}')  # not UTF-8: cannot be read
    monitor = make(tmp_path)
    with caplog.at_level(logging.WARNING, logger="msprobe_engine"):
        for _ in range(5):
            take_effect(monitor)
        assert len(_warnings(caplog)) == 1
        monitor.writer.flush()  # no look in flight while the file is rewritten (it could read it half-written)
        write(tmp_path, "{not json")  # changed: reported again, once
        for _ in range(3):
            take_effect(monitor)
        monitor.close()
    assert len(_warnings(caplog)) == 2
