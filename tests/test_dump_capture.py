"""What the dump captures, and that it changes nothing: functions, numbers, in-place code."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from dump_helpers import tiny_gpt_dump, train_tiny_gpt
from msprobe_engine.frameworks.torch.capture.api import push_mode, remove_mode
from msprobe_engine.dump import PrecisionDebugger, load_dump


def _data(root, step=0) -> dict:
    return load_dump(root)[(step, None)].data


def _run(tmp_path, fn, model=None, **config) -> dict:
    with PrecisionDebugger({"dump_path": str(tmp_path), "strict": True, **config}) as debugger:
        with debugger.step_scope(model):
            fn()
    return _data(tmp_path)


def test_imported_names_are_captured_and_no_function_is_replaced(tmp_path):
    from torch import relu
    originals = (F.gelu, torch.relu, torch.Tensor.add, torch.matmul, torch.distributed.all_reduce)
    seen = []

    def run():
        x = torch.randn(3, 3)
        seen.append((F.gelu, torch.relu, torch.Tensor.add, torch.matmul, torch.distributed.all_reduce))
        relu(x)
        x.add(1)
        torch.matmul(x, x)
        assert F.gelu is originals[0]  # what Megatron's "activation_func must be F.gelu" checks

    data = _run(tmp_path, run, level="L1")
    assert seen == [originals] and (F.gelu, torch.relu) == originals[:2]
    assert {"Torch.relu.0.forward", "Tensor.add.0.forward", "Torch.matmul.0.forward"} <= set(data)


@pytest.mark.parametrize("level", ["L0", "L1", "mix"])
def test_training_numbers_are_bitwise_unchanged(tmp_path, level):
    plain = train_tiny_gpt(3)
    debugger = PrecisionDebugger({"dump_path": str(tmp_path), "level": level, "strict": True})
    dumped = train_tiny_gpt(3, debugger)
    debugger.close()
    assert dumped == plain
    assert debugger.transfers == 3  # one device-to-host copy of statistics per dumped step
    assert sorted(load_dump(tmp_path)) == [(0, None), (1, None), (2, None)]


class InPlace(nn.Module):
    """Code that register_full_backward_hook breaks: in-place ops on module outputs and inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h += 1.0
        return self.act(h) * 2


def test_in_place_code_keeps_working_and_gradients_are_exact(tmp_path):
    torch.manual_seed(0)
    model, x = InPlace(), torch.randn(3, 4, requires_grad=True)
    data = _run(tmp_path, lambda: model(x).sum().backward(), model, level="mix", task="tensor")
    rank = load_dump(tmp_path)[(0, None)]
    fc_out = data["Module.fc.Linear.forward.0"]["output"][0]
    relu_in = data["Module.act.ReLU.forward.0"]["input_args"][0]
    h = model.fc(x).detach()
    assert fc_out["Min"] == h.min().item()  # measured before `h += 1` changed it
    assert relu_in["Min"] == (h + 1).min().item()  # measured before the in-place ReLU
    assert data["Tensor.__iadd__.0.forward"]["input_args"][0]["Max"] == h.max().item()

    def grad(entry, role, i=0):
        name = data[entry][role][i]["data_name"]
        return torch.load(rank.path / "dump_tensor_data" / name, weights_only=True)

    relu_mask = (h + 1 > 0).float()
    # modules whose output is written in place (fc's by `h += 1`, act's within the call) have no
    # backward entry, as in the predecessor's dump (torch's full backward hook does not fire there)
    assert "Module.fc.Linear.backward.0" not in data and "Module.act.ReLU.backward.0" not in data
    assert torch.equal(grad("Functional.linear.0.backward", "input"), 2 * relu_mask)
    assert torch.allclose(grad("Functional.linear.0.backward", "output", 1), (2 * relu_mask) @ model.fc.weight)
    assert torch.allclose(grad("Functional.linear.0.backward", "output", 1), x.grad)
    assert torch.equal(grad("Module.fc.Linear.parameters_grad.0", "weight"), model.fc.weight.grad)
    # an API's backward: the gradients out of the node that made its output, as the predecessor
    # records them (addmm: bias, input, weight.t())
    assert torch.equal(grad("Functional.linear.0.backward", "output", 2), model.fc.weight.grad.t())


def test_checkpoint_recomputation_is_not_recorded_twice(tmp_path):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    outer = nn.ModuleDict({"block": block})
    x = torch.randn(2, 4, requires_grad=True)
    data = _run(tmp_path, lambda: checkpoint(block, x, use_reentrant=False).sum().backward(), outer, level="mix")
    assert [n for n in data if n.startswith("Module.block.0")] == [
        "Module.block.0.Linear.forward.0", "Module.block.0.Linear.backward.0", "Module.block.0.Linear.parameters_grad.0"]
    assert "Functional.linear.1.forward" not in data and "Functional.linear.0.backward" in data


def test_steps_ranks_counters_and_list(tmp_path):
    root = tiny_gpt_dump(tmp_path / "a", steps=3, level="L1", step=[1, 2],
                         list=["layer_norm", "Tensor.__add__.1.forward"])
    dumps = load_dump(root)
    assert sorted(dumps) == [(1, None), (2, None)]
    names = list(dumps[(2, None)].data)
    # `x + y` is Tensor.__add__ (0: embedding + position, 1: the first residual)
    assert names[:3] == ["Functional.layer_norm.0.forward", "Tensor.__add__.1.forward",
                         "Functional.layer_norm.1.forward"]
    assert {n.split(".")[1] for n in names} == {"layer_norm", "__add__"}
    assert "Tensor.__add__.1.backward" not in names and "Functional.layer_norm.0.backward" in names


def test_scope_bounds_a_range_in_execution_order(tmp_path):
    root = tiny_gpt_dump(tmp_path, steps=1, level="mix",
                         scope=["Module.layers.0.ln2.LayerNorm.forward.0", "Functional.linear.1.forward"])
    names = list(_data(root))
    # entries that begin inside the range are kept (mlp.2 and mlp began before linear.1 ended it)
    assert names == ["Functional.layer_norm.1.forward", "Module.layers.0.ln2.LayerNorm.forward.0",
                     "Functional.linear.0.forward", "Module.layers.0.mlp.0.Linear.forward.0",
                     "Functional.gelu.0.forward", "Module.layers.0.mlp.1.GELU.forward.0", "Functional.linear.1.forward",
                     "Module.layers.0.mlp.2.Linear.forward.0", "Module.layers.0.mlp.Sequential.forward.0"]


def test_mix_list_expands_a_module(tmp_path):
    root = tiny_gpt_dump(tmp_path, steps=1, level="mix", list=["Module.layers.1.mlp.Sequential.forward.0"])
    assert list(_data(root)) == [  # its forward, expanded; API counters run over the whole step
        "Functional.linear.2.forward", "Module.layers.1.mlp.0.Linear.forward.0", "Functional.gelu.1.forward",
        "Module.layers.1.mlp.1.GELU.forward.0", "Functional.linear.3.forward", "Module.layers.1.mlp.2.Linear.forward.0",
        "Module.layers.1.mlp.Sequential.forward.0"]


def test_injected_nan_shows_in_the_dump(tmp_path):
    root = tiny_gpt_dump(tmp_path, steps=2, level="L0", inject_layer="layers.1.mlp", inject_step=1)
    before, after = _data(root, 0), _data(root, 1)
    name = "Module.layers.1.mlp.Sequential.forward.0"
    assert before[name]["output"][0]["Max"] == before[name]["output"][0]["Max"]
    assert after[name]["output"][0]["Max"] != after[name]["output"][0]["Max"]  # nan
    (file,) = (root / "step1").glob("proc*/dump.json")
    text = file.read_text()
    assert "NaN" in text and json.loads(text)["level"] == "L0"


def test_the_mode_comes_off_the_stack_under_other_modes():
    class Other(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    ours, other = Other(), Other()
    push_mode(ours)
    with other:
        remove_mode(ours)
        assert torch.overrides._get_current_function_mode_stack() == [other]
    assert torch.overrides._get_current_function_mode_stack() == []


def test_an_error_inside_the_tool_is_reported_and_training_goes_on(tmp_path, monkeypatch, caplog):
    from msprobe_engine.frameworks.torch.capture.recorder import Recorder

    def broken(self, tensor, name):
        raise RuntimeError("boom")

    monkeypatch.setattr(Recorder, "_slot", broken)
    debugger = PrecisionDebugger({"dump_path": str(tmp_path), "level": "mix"})
    assert train_tiny_gpt(2, debugger) == train_tiny_gpt(2)
    debugger.close()
    assert debugger.hook_errors["API"] > 1 and debugger.steps_written == 2
    assert sum("msprobe dump: error in API" in r.message for r in caplog.records) == 1


def test_operators_are_named_as_written_and_tensor_is_restored(tmp_path):
    originals = {name: torch.Tensor.__dict__.get(name) for name in ("__add__", "__radd__", "__iadd__", "__mul__")}
    x, y = torch.ones(3), torch.full((3,), 2.0)

    def run():
        x + y
        x.add(y)
        2 * x
        z = x.clone()
        z += 1
        z.add_(1)
        z > y

    data = _run(tmp_path, run, level="L1")
    assert list(data) == ["Tensor.__add__.0.forward", "Tensor.add.0.forward", "Tensor.__rmul__.0.forward",
                          "Tensor.__iadd__.0.forward", "Tensor.add_.0.forward", "Tensor.__gt__.0.forward"]
    assert {name: torch.Tensor.__dict__.get(name) for name in originals} == originals  # put back at stop()
    assert data["Tensor.__rmul__.0.forward"]["input_args"][1] == {"type": "int", "value": 2}


def test_python_apis_record_the_arguments_as_the_caller_wrote_them(tmp_path):
    x, w, b = torch.randn(2, 4), torch.ones(4), torch.zeros(4)
    args = (x, [4], w, b, 1e-5)

    def run():
        F.layer_norm(x, [4], w, b, 1e-5)           # all positional (as nn.LayerNorm calls it)
        F.layer_norm(x, [4], weight=w, eps=1e-3)   # keywords as written; bias left out
        F.layer_norm(*args)                        # unpacked: its arguments as torch re-passes them

    data = _run(tmp_path, run, level="L1")
    first, second, third = (data[f"Functional.layer_norm.{i}.forward"] for i in range(3))
    assert len(first["input_args"]) == 5 and first["input_kwargs"] == {}
    assert first["input_args"][4] == {"type": "float", "value": 1e-5}
    assert len(second["input_args"]) == 2 and list(second["input_kwargs"]) == ["weight", "eps"]
    assert len(third["input_args"]) == 2 and list(third["input_kwargs"]) == ["weight", "bias"]  # eps: default


def test_a_tensor_given_twice_to_a_module_gets_its_gradient_once(tmp_path):
    torch.manual_seed(0)
    attn = nn.ModuleDict({"attn": nn.MultiheadAttention(4, 1, batch_first=True)})
    x = torch.randn(1, 3, 4, requires_grad=True)
    data = _run(tmp_path, lambda: attn["attn"](x, x, x, need_weights=False)[0].sum().backward(), attn,
                level="L0", task="tensor")
    rank = load_dump(tmp_path)[(0, None)]
    grads = data["Module.attn.MultiheadAttention.backward.0"]["output"]
    assert grads[1] is None and grads[2] is None  # not split by position: all of it in the first
    whole = torch.load(rank.path / "dump_tensor_data" / grads[0]["data_name"], weights_only=True)
    assert torch.equal(whole, x.grad)


@pytest.mark.parametrize("config, names", [
    ({}, ["Functional.linear.0.forward", "Torch.tanh.0.forward"]),                      # FOCUS (default)
    ({"risk_level": "CORE"}, ["Functional.linear.0.forward"]),
    ({"risk_level": "ALL"}, ["Torch.zeros_like.0.forward", "Tensor.reshape.0.forward",
                             "Functional.linear.0.forward", "Torch.tanh.0.forward"]),
    ({"risk_level": "CORE", "list": ["reshape"]}, ["Tensor.reshape.0.forward"]),      # a list decides alone
])
def test_risk_level_picks_apis_as_the_predecessor(tmp_path, config, names):
    x, w = torch.randn(2, 3), torch.randn(4, 6)

    def run():
        torch.zeros_like(x)
        torch.tanh(F.linear(x.reshape(1, 6), w))

    assert list(_run(tmp_path, run, level="L1", **config)) == names


class ReadsItsOutput(nn.Module):
    """Returns `y`, which it reads again itself (``y * 3``), and `h`, read only by itself (a pooler's input)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.fc(x)
        h = y * 2
        return y, y * 3, h, h.mean(0)


def test_a_module_s_backward_input_is_the_gradient_at_its_boundary(tmp_path):
    """As torch's full backward hook gives it: without what the module's own reads of an output
    sent back to it (None when nothing came from outside)."""
    torch.manual_seed(0)
    model, x = nn.ModuleDict({"m": ReadsItsOutput()}), torch.randn(3, 4)

    def loss() -> torch.Tensor:
        y, y3, _, pooled = model["m"](x)
        return (y * torch.arange(4.0)).sum() + y3.sum() + pooled.sum()

    hooked: list = []
    handle = model["m"].register_full_backward_hook(lambda m, gi, go: hooked.extend(go))
    loss().backward()
    handle.remove()
    data = _run(tmp_path, lambda: loss().backward(), model, level="L0", task="tensor")
    rank = load_dump(tmp_path)[(0, None)]
    recorded = data["Module.m.ReadsItsOutput.backward.0"]["input"]
    assert recorded[2] is None and hooked[2] is None
    for i in (0, 1, 3):
        got = torch.load(rank.path / "dump_tensor_data" / recorded[i]["data_name"], weights_only=True)
        torch.testing.assert_close(got, hooked[i])  # the total less the reads: equal but for rounding


def test_an_in_place_call_on_a_module_output_sends_one_gradient_at_mix(tmp_path):
    """``h = fc(x); h += r``: the predecessor's module hook makes h a view, whose in-place call has
    one gradient (h's); at L1 (no module hooks) both inputs get theirs."""
    torch.manual_seed(0)
    fc, other, x = nn.Linear(4, 4), nn.Linear(4, 4), torch.randn(2, 4)
    model = nn.ModuleDict({"fc": fc, "other": other})

    def step() -> None:
        h = fc(x)
        h += other(x)
        h.sum().backward()

    counts = {}
    for level in ("mix", "L1"):
        entry = _run(tmp_path / level, step, model, level=level)["Tensor.__iadd__.0.backward"]
        counts[level] = len(entry["output"])
        assert entry["output"][0] == entry["input"][0]
    assert counts == {"mix": 1, "L1": 2}


@pytest.mark.parametrize("summary_mode", ["statistics", "md5"])
def test_a_tensor_value_recorded_again_shares_its_slot_unless_slots_are_written_later(tmp_path, monkeypatch,
                                                                                      summary_mode):
    from msprobe_engine.frameworks.torch.capture.recorder import Recorder

    steps = []
    finish = Recorder.finish_step
    monkeypatch.setattr(Recorder, "finish_step", lambda self: steps.append(finish(self)) or steps[-1])
    debugger = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1", "summary_mode": summary_mode})
    x = torch.randn(4, 4)
    with debugger.step_scope():
        y = torch.relu(x)
        torch.sigmoid(y)  # y as it was returned
        y.mul_(2)
        torch.tanh(y)  # y changed in place: a value of its own
    debugger.close()
    entries = steps[0].entries
    returned = entries["Torch.relu.0.forward"]["output"][0]
    read, written = (entries[f"Torch.{n}.0.forward"]["input_args"][0] for n in ("sigmoid", "tanh"))
    assert (read is returned) == (summary_mode == "statistics")  # md5: each slot gets its checksum later
    assert written is not returned and written.row != returned.row
    records = next(iter(load_dump(tmp_path).values())).data
    assert records["Torch.sigmoid.0.forward"]["input_args"][0] == records["Torch.relu.0.forward"]["output"][0]


class _InPlaceBlock(nn.Module):
    """In-place writes the API mode saw at L0: into an input inside a call, into an output after it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.other, self.act = nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h += self.other(x)       # an output written after its call: no fc backward entry
        return self.act(h) * 2   # the ReLU's input written within the call


def test_l0_without_the_api_mode_records_what_the_mode_recorded(tmp_path, monkeypatch):
    """L0 measures at its hooks and finds rewritten outputs by version: the same records as with
    the API mode, and no mode pushed."""
    from msprobe_engine.frameworks.torch.capture.recorder import Recorder
    torch.manual_seed(0)
    model, x = _InPlaceBlock(), torch.randn(2, 4, requires_grad=True)
    modes = []

    def step() -> None:
        modes.append(torch.overrides._get_current_function_mode_stack())
        model(x).sum().backward()

    eager = _run(tmp_path / "eager", step, model, level="L0")
    monkeypatch.setattr(Recorder, "measures_at_hooks", False)
    guarded = _run(tmp_path / "mode", step, model, level="L0")
    assert modes[0] == [] and len(modes[1]) == 1
    assert eager == guarded
    assert "Module.fc.Linear.forward.0" in eager and "Module.fc.Linear.backward.0" not in eager
