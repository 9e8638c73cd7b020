"""The first culprit: a fault injected into a named layer at a named step is named by the incident."""
import numpy as np
import pytest
import torch
from torch import nn

from examples.tiny_gpt import inject
from incident_helpers import config, gpt_and_adam, inject_backward, read_incident, run
from msprobe_engine.analysis import analyze
from msprobe_engine.incident import first_culprit
from msprobe_engine.stats import reference_partial
from msprobe_engine.stats.table import MetricKey, StatTable
from msprobe_integrations.torch import TorchMonitor

CLASSES = {"layers.1.mlp.0": "Linear", "layers.0.ln1": "LayerNorm", "layers.1.ln2": "LayerNorm",
           "head": "Linear", "layers.1.mlp.2": "Linear", "layers.0.mlp.0": "Linear"}


def culprit_of(tmp_path, step, rule="non_finite"):
    return read_incident(tmp_path / "incidents" / f"step{step}-rank0-{rule}")["culprit"]


@pytest.mark.parametrize("layer,kind", [("layers.1.mlp.0", "nan"), ("layers.0.ln1", "inf"),
                                        ("layers.1.ln2", "nan"), ("head", "inf")])
def test_a_forward_fault_is_named(tmp_path, layer, kind):
    model, opt = gpt_and_adam()
    monitor = None
    inject(model, layer, lambda: monitor.step, 3, kind)
    monitor = TorchMonitor(model, opt, config(tmp_path, watch={"activation_grads": True}))
    run(model, opt, monitor, 5)
    monitor.close()
    culprit = culprit_of(tmp_path, 3)
    assert (culprit["phase"], culprit["call"], culprit["module_class"]) == ("forward", layer, CLASSES[layer])
    assert culprit["dump_entry"] == f"Module.{layer}.{CLASSES[layer]}.forward.0"
    assert culprit["first_bad"].startswith(f"actv/{layer}/output")


@pytest.mark.parametrize("layer,how,kind", [("layers.1.mlp.2", "function", "nan"), ("layers.0.mlp.0", "full_hook", "inf"),
                                            ("layers.1.ln2", "full_hook", "nan")])
def test_a_backward_fault_is_named(tmp_path, layer, how, kind):
    model, opt = gpt_and_adam()
    monitor = None
    inject_backward(model, layer, lambda: monitor.step, 2, kind, how)
    monitor = TorchMonitor(model, opt, config(tmp_path, watch={"activation_grads": True}))
    run(model, opt, monitor, 4)
    monitor.close()
    culprit = culprit_of(tmp_path, 2)
    assert (culprit["phase"], culprit["call"]) == ("backward", layer)
    assert culprit["dump_entry"] == f"Module.{layer}.{CLASSES[layer]}.backward.0"
    # the step's statistics dump says the same to the offline analysis
    assert analyze(tmp_path / "incidents" / "step2-rank0-non_finite" / "dump")[0].first_critical.entry \
        == culprit["dump_entry"]


def test_without_activation_gradients_the_backward_culprit_is_estimated(tmp_path):
    model, opt = gpt_and_adam()
    monitor = None
    inject_backward(model, "layers.1.mlp.2", lambda: monitor.step, 2)
    monitor = TorchMonitor(model, opt, config(tmp_path))
    run(model, opt, monitor, 4)
    monitor.close()
    culprit = culprit_of(tmp_path, 2)
    assert (culprit["phase"], culprit["call"]) == ("backward", "layers.1.mlp.2")
    assert culprit["method"].startswith("estimate")


class Divides(nn.Module):
    """Its own code (not a child) makes the inf: its children see a bad input or none."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.after = nn.Linear(4, 4)
        self.scale = 1.0

    def forward(self, x):
        return self.after(self.inner(x) / self.scale)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.block = Divides()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.block(self.first(x))).sum()


@pytest.mark.parametrize("fault,call,first_bad", [
    ("block", "block", "actv_in/block.after/input.0"),   # the parent's own code: x / 0
    ("data", None, "actv_in/first/input.0"),            # before any watched module
])
def test_nesting_a_parent_is_named_only_for_its_own_code(tmp_path, fault, call, first_bad):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TorchMonitor(model, opt, config(tmp_path))
    for step in range(3):
        x = torch.randn(2, 4)
        model.block.scale = 0.0 if fault == "block" and step == 1 else 1.0
        if fault == "data" and step == 1:
            x[0, 0] = float("nan")
        opt.zero_grad()
        monitor.run_step(lambda: (model(x).backward(), opt.step()))
        monitor.step_end()
    monitor.close()
    culprit = culprit_of(tmp_path, 1)
    assert (culprit["phase"], culprit["call"], culprit["first_bad"]) == ("forward", call, first_bad)


def test_a_spike_names_the_first_module_far_above_its_running_average(tmp_path):
    model, opt = gpt_and_adam()
    monitor = None
    inject(model, "layers.1.mlp.0", lambda: monitor.step, 8, "spike")
    rules = [{"rule": "spike", "metrics": ["actv/*/output/norm"], "factor": 10.0, "warmup": 4}]
    monitor = TorchMonitor(model, opt, config(tmp_path, alerts=rules))
    run(model, opt, monitor, 9)
    monitor.close()
    incident = read_incident(tmp_path / "incidents" / "step8-rank0-spike")
    assert incident["culprit"]["call"] == "layers.1.mlp.0"
    top = {d["row"]: d["deviation"] for d in incident["top_deviations"][:5]}
    assert top["actv/layers.1.mlp.0/output"] > 100


def test_without_a_call_graph_a_call_reads_its_own_input_rows():
    """Integrations that note no graph (their hooks measure inputs themselves) still get a culprit."""
    nan = np.array([np.nan])
    rows = {MetricKey("actv", "a", "input.0"): [1.0], MetricKey("actv", "a", "output"): [2.0],
            MetricKey("actv", "b", "input.0"): [2.0], MetricKey("actv", "b", "output"): nan,
            MetricKey("actv", "c", "input.0"): nan, MetricKey("actv", "c", "output"): nan}
    table = StatTable(list(rows), np.stack([reference_partial(np.asarray(v)) for v in rows.values()]))
    bad = np.isnan(table.partials[:, 0])
    culprit = first_culprit(table, bad)
    assert (culprit.phase, culprit.call, culprit.bad) == ("forward", "b", ["actv/b/output"])


def test_the_parameter_gradient_estimate_says_why_it_is_an_estimate():
    from types import SimpleNamespace

    import numpy as np

    from msprobe_engine.incident.culprit import first_culprit
    from msprobe_engine.stats.table import MetricKey

    keys = [MetricKey("actv", "fc", "output"), MetricKey("grad", "fc.weight", "")]
    without = first_culprit(SimpleNamespace(keys=keys), np.array([False, True]))
    watched = first_culprit(SimpleNamespace(keys=keys[:1] + [MetricKey("actv_grad", "fc", "output")] + keys[1:]),
                            np.array([False, False, True]))
    assert without.call == watched.call == "fc"
    assert "(no activation gradients watched)" in without.method
    assert "(the watched activation gradients were all good)" in watched.method
