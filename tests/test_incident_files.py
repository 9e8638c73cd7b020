"""The incident directory: its files, one per episode with a limit, written off the training
thread, and a failing write never stops the run."""
import errno
import json
import logging
import os
import subprocess
import threading

import pytest

from examples.tiny_gpt import inject
from incident_helpers import config, gpt_and_adam, read_incident, run
from msprobe_engine.analysis import analyze
from msprobe_engine.dump import load_dump
from msprobe_engine.incident import writer as incident_writer
from msprobe_engine.incident.environment import config_hash
from msprobe_integrations.torch import TorchMonitor


def test_the_incident_directory_holds_the_evidence(tmp_path):
    model, opt = gpt_and_adam()
    monitor = None
    inject(model, "layers.1.mlp.0", lambda: monitor.step, 5, "nan")
    monitor = TorchMonitor(model, opt, config(tmp_path, ring_buffer=4, sinks=["jsonl"]))
    run(model, opt, monitor, 7)
    monitor.close()
    directory = tmp_path / "incidents" / "step5-rank0-non_finite"
    incident = read_incident(directory)
    assert incident["step"] == 5 and incident["micro_steps"] == 1 and incident["rank"] == 0
    assert incident["world"]["world_size"] == 1 and incident["world"]["rank"] == 0
    assert (incident["rule"], incident["action"], incident["threshold"]) == ("non_finite", "skip", 0.0)
    assert incident["tensor"] == "actv/layers.1.mlp.0/output/nan_count" and incident["value"] == 1
    assert incident["culprit"]["call"] == "layers.1.mlp.0"
    assert incident["top_deviations"][0]["row"] == "actv/layers.1.mlp.0/output"
    assert len(incident["top_deviations"]) == 10  # incidents.top_k
    assert incident["config_hash"] == config_hash(monitor.config)
    assert {"python", "numpy", "torch", "msprobe-integrations"} <= set(incident["versions"])

    lines = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 3, 4, 5]  # the last ring_buffer records
    assert lines[-1]["alerts"][0]["tag"] == incident["tensor"]

    dump = load_dump(directory / "dump")  # strict: the schema holds
    assert list(dump) == [(5, None)] and dump[(5, None)].task == "statistics"
    assert str(directory / incident["files"]["dump"]) == str(dump[(5, None)].dump_json)
    first = analyze(directory / "dump")[0].first_critical
    assert first.entry == incident["culprit"]["dump_entry"] == "Module.layers.1.mlp.0.Linear.forward.0"


@pytest.mark.parametrize("limit,expected", [(1, ["step2-rank0-non_finite"]),
                                            (10, ["step2-rank0-non_finite", "step6-rank0-non_finite"])])
def test_one_incident_per_episode_up_to_the_limit(tmp_path, limit, expected):
    model, opt = gpt_and_adam()
    monitor = None
    for step in (2, 3, 4, 6):  # an episode of three steps, then another one
        inject(model, "layers.0.mlp.2", lambda: monitor.step, step, "inf")
    monitor = TorchMonitor(model, opt, config(tmp_path, incidents={"max_incidents": limit}))
    run(model, opt, monitor, 8)
    monitor.close()
    starts = [e.step for e in monitor.alert_log if e.phase == "start"]
    assert starts[0] == 2 and starts[-1] == 6 and 3 not in starts and 4 not in starts
    assert sorted(p.name for p in (tmp_path / "incidents").iterdir()) == expected
    assert monitor.incidents.over_limit == 2 - len(expected)


def test_incident_files_are_written_on_the_writer_thread(tmp_path, monkeypatch):
    threads = []
    for name in ("write_evidence", "write_report"):
        real = getattr(incident_writer.IncidentFiles, name)

        def spy(self, *args, real=real):
            threads.append(threading.current_thread().name)
            return real(self, *args)
        monkeypatch.setattr(incident_writer.IncidentFiles, name, spy)
    model, opt = gpt_and_adam()
    monitor = None
    inject(model, "head", lambda: monitor.step, 1, "nan")
    monitor = TorchMonitor(model, opt, config(tmp_path))
    run(model, opt, monitor, 3)
    monitor.close()
    assert threads == ["msprobe-writer", "msprobe-writer"]


def _read_only(tmp_path, monkeypatch, request):
    """A read-only directory; as root (who may write anywhere), an immutable one (chattr +i)."""
    target = tmp_path / "read_only"
    target.mkdir()
    target.chmod(0o555)
    if os.access(target, os.W_OK):
        if subprocess.run(["chattr", "+i", str(target)], capture_output=True).returncode != 0:
            pytest.skip("running as root on a file system without chattr: no read-only directory")
        request.addfinalizer(lambda: subprocess.run(["chattr", "-i", str(target)]))
    return target


def _blocked(tmp_path, monkeypatch, request):
    target = tmp_path / "a_file"
    target.write_text("not a directory")
    return target


def _failing_write(error):
    def trouble(tmp_path, monkeypatch, request):
        def fail(path, text):
            raise error
        monkeypatch.setattr(incident_writer, "write_file", fail)
        return tmp_path / "incidents"
    return trouble


_disk_full = _failing_write(OSError(errno.ENOSPC, "No space left on device"))
_permission_denied = _failing_write(PermissionError(errno.EACCES, "Permission denied"))


@pytest.mark.parametrize("trouble", [_read_only, _blocked, _disk_full, _permission_denied])
def test_a_failing_incident_write_is_reported_and_the_run_goes_on(tmp_path, monkeypatch, request, caplog, trouble):
    target = trouble(tmp_path, monkeypatch, request)
    model, opt = gpt_and_adam()
    monitor = None
    inject(model, "layers.1.mlp.0", lambda: monitor.step, 2, "nan")
    monitor = TorchMonitor(model, opt, config(tmp_path / "run", sinks=["jsonl"], incidents={"dir": str(target)}))
    with caplog.at_level(logging.ERROR, logger="msprobe_engine"):
        losses = run(model, opt, monitor, 5)
        monitor.close()  # strict mode: an error of the tool would be raised here
    assert len(losses) == 5 and monitor.records_written == 5
    assert monitor.incidents.failures and all("step2-rank0-non_finite" in f for f in monitor.incidents.failures)
    assert any("could not write" in r.message and "the training goes on" in r.message for r in caplog.records)
    lines = (tmp_path / "run" / "rank0" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 5
