"""Run directories: <output_dir>/<run name>/rank<R>/, never mixed; resume continues a run."""
import json
import re

import pytest
import torch

from msprobe_engine.analysis.runs import compare_runs
from msprobe_engine.cli import main
from msprobe_engine.config import ConfigError
from msprobe_engine.monitor import Monitor
from msprobe_engine.run_dir import RUN_NAME_ENV
from msprobe_integrations.torch import TorchMonitor


@pytest.fixture(autouse=True)
def default_run_names(monkeypatch):
    monkeypatch.delenv(RUN_NAME_ENV, raising=False)  # conftest keeps older tests in <output_dir>/rank<R>


def run(config, losses, start=None):
    monitor = Monitor(config)
    for loss in losses:
        monitor.step_end(loss)
    monitor.close()
    return monitor


def steps_of(rank_dir):
    return [json.loads(line)["step"] for line in (rank_dir / "metrics.jsonl").read_text().splitlines()]


def test_default_run_name_is_a_timestamp_and_two_runs_never_mix(tmp_path):
    first = run({"output_dir": str(tmp_path)}, [1.0, 2.0])
    second = run({"output_dir": str(tmp_path)}, [3.0])
    assert first.run.root.parent == tmp_path and re.fullmatch(r"\d{8}-\d{6}(-\d+)?", first.run.name)
    assert first.run.root != second.run.root
    assert steps_of(first.run_dir) == [0, 1] and steps_of(second.run_dir) == [0]
    assert len(list(first.run_dir.glob("events.out.tfevents.*"))) == 1


def test_a_named_run_that_holds_data_is_refused_unless_resumed(tmp_path):
    config = {"output_dir": str(tmp_path), "run_name": "baseline"}
    first = run(config, [1.0, 2.0, 3.0])
    assert first.run_dir == tmp_path / "baseline" / "rank0"
    with pytest.raises(ConfigError, match=r"baseline/rank0 already holds a run .*resume: true"):
        Monitor(config)
    resumed = Monitor({**config, "resume": True})
    assert resumed.step == 3 and resumed.run.resumed  # the saved monitor state continues the steps
    for loss in (4.0, 5.0):
        resumed.step_end(loss)
    resumed.close()
    assert steps_of(first.run_dir) == [0, 1, 2, 3, 4]


def test_a_directory_of_monitors_that_recorded_nothing_is_not_a_run(tmp_path):
    config = {"output_dir": str(tmp_path), "run_name": "empty"}
    Monitor(config).close()  # files created, no step recorded
    monitor = run(config, [1.0])
    assert steps_of(monitor.run_dir) == [0]
    crashed = tmp_path / "crashed" / "rank0"
    crashed.mkdir(parents=True)
    (crashed / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match="crashed/rank0 already holds a run"):
        Monitor({"output_dir": str(tmp_path), "run_name": "crashed"})
    events_only = {"output_dir": str(tmp_path), "run_name": "tb", "sinks": ["tensorboard"]}
    Monitor(events_only).close()
    (tmp_path / "tb" / "rank0" / "monitor_state.json").unlink()  # as after a crash: the event file decides
    tb = run(events_only, [1.0])
    (tb.run_dir / "monitor_state.json").unlink()
    with pytest.raises(ConfigError, match="tb/rank0 already holds a run"):
        Monitor(events_only)


def test_an_alert_open_when_the_run_stopped_is_still_open_after_resume(tmp_path):
    config = {"output_dir": str(tmp_path), "run_name": "r", "sinks": ["jsonl"]}
    run(config, [1.0, float("nan")])
    run({**config, "resume": True}, [float("nan"), 1.0])
    alert = [json.loads(line)["metrics"]["Health/open_alert/non_finite"]
             for line in (tmp_path / "r" / "rank0" / "metrics.jsonl").read_text().splitlines()]
    assert alert == [0.0, 1.0, 1.0, 0.0]


def test_the_alert_count_goes_on_after_resume(tmp_path):
    config = {"output_dir": str(tmp_path), "run_name": "r", "sinks": ["jsonl"]}
    run(config, [1.0, float("nan"), 1.0])  # one episode: steps 1..1
    run({**config, "resume": True}, [float("nan"), 1.0])  # the second episode: step 3
    counts = [json.loads(line)["metrics"]["Health/alerts"]
              for line in (tmp_path / "r" / "rank0" / "metrics.jsonl").read_text().splitlines()]
    assert counts == [0.0, 1.0, 1.0, 2.0, 2.0]
    state = json.loads((tmp_path / "r" / "rank0" / "monitor_state.json").read_text())
    assert state["alerts_started"] == 2
    del state["alerts_started"]  # a state saved before the count was: it starts from 0
    (tmp_path / "r" / "rank0" / "monitor_state.json").write_text(json.dumps(state))
    resumed = run({**config, "resume": True}, [float("nan")])
    assert resumed.history[-1].metrics["Health/alerts"] == 1.0


def test_resume_without_a_name_continues_the_latest_run(tmp_path):
    run({"output_dir": str(tmp_path), "run_name": "old"}, [1.0])
    latest = run({"output_dir": str(tmp_path), "run_name": "new"}, [1.0, 2.0])
    resumed = run({"output_dir": str(tmp_path), "resume": True}, [3.0])
    assert resumed.run.root == latest.run.root
    assert steps_of(latest.run_dir) == [0, 1, 2]


def test_the_run_name_from_the_environment_and_bad_names(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_NAME_ENV, "from-env")
    assert run({"output_dir": str(tmp_path)}, [1.0]).run_dir == tmp_path / "from-env" / "rank0"
    with pytest.raises(ConfigError, match="run_name: 'a/b' must be a plain directory name"):
        Monitor({"output_dir": str(tmp_path), "run_name": "a/b"})


def test_incidents_go_into_their_run(tmp_path):
    monitor = run({"output_dir": str(tmp_path), "run_name": "r"}, [1.0, float("nan")])
    assert (tmp_path / "r" / "incidents" / "step1-rank0-non_finite" / "incident.json").is_file()
    assert monitor.incidents.root == tmp_path / "r" / "incidents"


def test_compare_takes_run_directories(tmp_path, capsys):
    run({"output_dir": str(tmp_path), "run_name": "a"}, [1.0, 2.0, 3.0])
    run({"output_dir": str(tmp_path), "run_name": "b"}, [1.0, 2.5, 3.0])
    found = compare_runs(tmp_path / "a", tmp_path / "b")
    assert (found.first.step, found.first.tag) == (1, "train/loss")
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert main(["compare", str(tmp_path), str(tmp_path / "b")]) == 1
    assert "holds 2 runs (a, b): give one run directory" in capsys.readouterr().err


def test_health_series_in_plain_pytorch(tmp_path):
    """Health/* comes first in each record; alerts and skipped steps are 0/1 every step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TorchMonitor(model, optimizer, {"output_dir": str(tmp_path), "run_name": "h", "sinks": ["jsonl"],
                                              "alerts": [{"rule": "non_finite", "action": "skip"}]})
    for step in range(6):
        x = torch.randn(3, 4)
        if step == 4:  # after the running averages' warm-up
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        loss.backward()
        monitor.report_loss(loss)
        optimizer.step()
        optimizer.zero_grad()
        monitor.step_end()
    monitor.close()
    records = [json.loads(line) for line in (tmp_path / "h" / "rank0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    for record in records:
        assert next(iter(record["metrics"])).startswith("Health/")
    column = {tag: [r["metrics"].get(tag) for r in records] for tag in
              ("Health/open_alert/non_finite", "Health/skipped", "train/skipped", "Health/non_finite/actv",
               "Health/non_finite/grad")}
    once = [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert column["Health/open_alert/non_finite"] == once
    assert column["Health/skipped"] == column["train/skipped"] == once
    assert column["Health/non_finite/actv"][4] >= 3 and column["Health/non_finite/actv"][5] == 0
    assert column["Health/non_finite/grad"][3] == 0 and column["Health/non_finite/grad"][4] > 0
    deviation = [r["metrics"]["Health/worst_deviation"] for r in records]
    assert deviation[4] == float("inf") and all(1.0 <= d < 1e3 for d in deviation[:4] + deviation[5:])


def test_a_second_writer_on_one_run_is_refused_with_the_holders_pid(tmp_path):
    import os

    config = {"output_dir": str(tmp_path), "run_name": "shared"}
    first = Monitor(config)  # built, no step yet: the directory holds no run, but it is taken
    with pytest.raises(ConfigError, match=rf"being written by another monitor \(pid {os.getpid()}"):
        Monitor(config)
    first.step_end(1.0)
    first.close()
    second = Monitor({**config, "resume": True})  # released at close
    second.close()


def test_a_writer_in_another_process_is_refused(tmp_path):
    import subprocess
    import sys

    config = {"output_dir": str(tmp_path), "run_name": "shared", "sinks": ["jsonl"]}
    holder = Monitor(config)
    code = ("import sys, json; from msprobe_engine.monitor import Monitor; from msprobe_engine.config import ConfigError\n"
            "try:\n    Monitor(json.loads(sys.argv[1]))\nexcept ConfigError as e:\n    print(e); sys.exit(3)\n")
    child = subprocess.run([sys.executable, "-c", code, json.dumps(config)], capture_output=True, text=True,
                           timeout=120)
    holder.close()
    assert child.returncode == 3 and "being written by another monitor" in child.stdout, child.stderr
    assert str(holder_pid := __import__("os").getpid()) in child.stdout and holder_pid > 0


def _saved(tmp_path, **changes):
    config = {"output_dir": str(tmp_path), "run_name": "r", "sinks": ["jsonl"],
              "alerts": [{"rule": "spike", "metrics": ["train/loss"]}]}
    run(config, [1.0, 2.0, 3.0])
    file = tmp_path / "r" / "rank0" / "monitor_state.json"
    state = json.loads(file.read_text())
    for key, value in changes.items():
        if value is KeyError:
            del state[key]
        elif key == "rule_state":
            state["rules"][0]["state"] = value
        else:
            state[key] = value
    file.write_text(json.dumps(state))
    return {**config, "resume": True}


@pytest.mark.parametrize("changes, field", [
    ({"step": "abc"}, "step"), ({"step": None}, "step"), ({"step": 1e999}, "step"), ({"step": -7}, "step"),
    ({"step": True}, "step"), ({"step": KeyError}, "step"), ({"episodes": KeyError}, "episodes"),
    ({"episodes": "x"}, "episodes"), ({"episodes": {"spike": {"start": 1}}}, "episodes"),
    ({"rules": "spike"}, "rules"), ({"rules": [7]}, r"rules\[0\]"), ({"rule_state": "abc"}, r"rules\[0\]"),
    ({"rule_state": {"average": {"train/loss": "x"}}}, r"rules\[0\] \(spike\).state"),
    ({"records_written": -1}, "records_written"), ({"incidents": [1]}, "incidents"),
    ({"alerts_started": "2"}, "alerts_started"),
])
def test_a_malformed_saved_state_is_a_config_error_naming_the_field(tmp_path, changes, field):
    config = _saved(tmp_path, **changes)
    with pytest.raises(ConfigError, match=rf"monitor state: {field}"):
        Monitor(config)
    Monitor(config | {"resume": False, "run_name": "other"}).close()  # the refused one gave its lock back
    (tmp_path / "r" / "rank0" / "monitor_state.json").unlink()
    Monitor(config).close()  # and the directory is free again


def test_resume_without_a_state_file_continues_after_the_last_recorded_step(tmp_path):
    for sinks in (["jsonl"], ["csv"]):
        config = {"output_dir": str(tmp_path), "run_name": sinks[0], "sinks": sinks}
        run(config, [1.0, 2.0, 3.0])
        (tmp_path / sinks[0] / "rank0" / "monitor_state.json").unlink()  # killed before close()
        resumed = run({**config, "resume": True}, [4.0])
        assert resumed.step == 4
    assert steps_of(tmp_path / "jsonl" / "rank0") == [0, 1, 2, 3]


def test_resume_without_a_state_file_or_records_is_refused(tmp_path):
    config = {"output_dir": str(tmp_path), "run_name": "tb", "sinks": ["tensorboard"]}
    run(config, [1.0, 2.0])
    (tmp_path / "tb" / "rank0" / "monitor_state.json").unlink()
    with pytest.raises(ConfigError, match="no monitor_state.json .* no step in metrics.jsonl or metrics.csv"):
        Monitor({**config, "resume": True})
