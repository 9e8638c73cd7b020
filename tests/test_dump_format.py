"""What the dump writes, checked against the reference examples (tests/fixtures) and the schema."""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from msprobe_engine.dump import PrecisionDebugger, iter_dump_tensors, load_dump, validate_dump_json

FIXTURES = Path(__file__).parent / "fixtures"
STATS = ("Max", "Min", "Mean", "Norm")


def _fixture(name: str) -> dict:
    return json.loads(next((FIXTURES / name).glob("step0/rank*/dump.json")).read_text())


def _form(value):
    """The dump with statistics replaced by their JSON type: names, nesting, field order, types."""
    if isinstance(value, dict):
        return [(k, type(v).__name__ if k in STATS else _form(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [_form(v) for v in value]
    return value


def _entries_form(doc: dict) -> dict:
    return {name: _form(entry) for name, entry in doc["data"].items()}


def _dump(tmp_path: Path, run, model: nn.Module | None = None, **config) -> tuple[dict, Path]:
    config = {"task": "tensor", "dump_path": str(tmp_path / "dump"), "strict": True, **config}
    with PrecisionDebugger(config) as debugger:
        with debugger.step_scope(model):
            run()
    (rank_dir,) = (tmp_path / "dump" / "step0").glob("proc*")
    return json.loads((rank_dir / "dump.json").read_text()), rank_dir


class Conv2Net(nn.Module):
    """The reference's L0 example: a Conv2d named conv2, 16 -> 32 channels, kernel 5."""

    def __init__(self) -> None:
        super().__init__()
        self.conv2 = nn.Conv2d(16, 32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(x)


def test_l0_matches_the_reference_example_field_for_field(tmp_path):
    torch.manual_seed(0)
    model, x = Conv2Net(), torch.rand(8, 16, 14, 14, requires_grad=True)
    # the reference is of the predecessor's 1.x releases: their spellings behind one option
    debugger = PrecisionDebugger({"task": "tensor", "dump_path": str(tmp_path), "level": "L0", "strict": True,
                                  "predecessor_format": "1.x"})
    debugger.start(model)
    model(x).sum().backward()
    debugger.stop()
    debugger.close()
    rank_dir = tmp_path / "step0" / "rank"  # a single process: rank/ in 1.x
    ours = json.loads((rank_dir / "dump.json").read_text())
    reference = _fixture("pytorch_L0")
    assert _entries_form(ours) == _entries_form(reference)
    assert [k for k in ours] == [k for k in reference]
    assert ours["dump_data_dir"] == str((rank_dir / "dump_tensor_data").resolve())
    dump = load_dump(tmp_path)[(0, None)]
    weight = next(r for r in iter_dump_tensors(ours) if r.label == "parameters.weight")
    assert torch.equal(torch.from_numpy(dump.load_tensor(weight)), model.conv2.weight.detach())
    grad = next(r for r in iter_dump_tensors(ours) if r.label == "parameters_grad.weight.0")
    assert torch.equal(torch.from_numpy(dump.load_tensor(grad)), model.conv2.weight.grad)
    assert grad.stat("Norm") == pytest.approx(model.conv2.weight.grad.double().norm().item(), rel=1e-6)


def test_l1_matches_the_reference_example_and_list_selects_by_name(tmp_path):
    x = torch.randn(32, 16, 28, 28, requires_grad=True)
    ours, rank_dir = _dump(tmp_path, lambda: F.relu(x).sum().backward(), level="L1", list=["relu"])
    reference = _fixture("pytorch_L1")
    assert _entries_form(ours) == _entries_form(reference)
    relu = torch.relu(x.detach())
    out = ours["data"]["Functional.relu.0.forward"]["output"][0]
    assert (out["Max"], out["Min"]) == (relu.max().item(), 0.0)
    assert out["Mean"] == pytest.approx(relu.double().mean().item(), rel=1e-6)
    assert out["Norm"] == pytest.approx(relu.double().norm().item(), rel=1e-6)
    grad_in = torch.load(rank_dir / "dump_tensor_data" / "Functional.relu.0.backward.output.0.pt", weights_only=True)
    assert torch.equal(grad_in, x.grad)
    assert json.loads((rank_dir / "construct.json").read_text()) == {}


def test_bool_int_empty_and_scalar_records(tmp_path):
    mask = torch.tensor([True, False, True])
    ints = torch.arange(3)

    def run():
        torch.where(mask, ints, torch.zeros(3, dtype=torch.long))
        torch.cat([torch.empty(0), torch.ones(2)])
        torch.tensor(-2.5).abs()

    doc, _ = _dump(tmp_path, run, task="statistics", level="L1", risk_level="ALL")  # cat: low risk
    assert validate_dump_json(doc) == []
    where = doc["data"]["Torch.where.0.forward"]
    assert {k: where["input_args"][0][k] for k in (*STATS, "dtype", "requires_grad")} == {
        "Max": True, "Min": False, "Mean": None, "Norm": None, "dtype": "torch.bool", "requires_grad": False}
    # integer tensors: Max and Min, no Mean or Norm (null, as the predecessor writes them)
    assert {k: where["input_args"][1][k] for k in STATS} == {"Max": 2, "Min": 0, "Mean": None, "Norm": None}
    empty = doc["data"]["Torch.cat.0.forward"]["input_args"][0][0]
    assert empty["shape"] == [0] and all(empty[k] is None for k in STATS)
    scalar = doc["data"]["Tensor.abs.0.forward"]["input_args"][0]
    assert (scalar["shape"], scalar["Max"], scalar["Norm"]) == ([], -2.5, 2.5)
    assert "data_name" not in scalar and doc["dump_data_dir"] is None


def test_non_tensor_arguments_are_described_as_the_predecessor_does(tmp_path):
    x = torch.randn(4, 6)
    y = x.clone()

    def run():
        x.reshape(torch.Size([6, 4]))
        y[1:3, ...] = 0.5
        x.to(torch.float64)
        F.softmax(x, dim=-1)

    doc, _ = _dump(tmp_path, run, task="statistics", level="L1", risk_level="ALL")  # reshape, to: low risk
    data = doc["data"]
    assert data["Tensor.reshape.0.forward"]["input_args"][1] == {"type": "torch.Size", "value": [6, 4]}
    assert data["Tensor.__setitem__.0.forward"]["input_args"][1:] == [
        [{"type": "slice", "value": [1, 3, None]}, {"type": "ellipsis", "value": "..."}],
        {"type": "float", "value": 0.5}]
    assert data["Tensor.to.0.forward"]["input_args"][1] == {"type": "torch.dtype", "value": "torch.float64"}
    assert data["Functional.softmax.0.forward"]["input_kwargs"] == {"dim": {"type": "int", "value": -1}}


def test_md5_mode_writes_the_crc32_of_the_bytes(tmp_path):
    x = torch.randn(5, 3).to(torch.bfloat16)
    doc, rank_dir = _dump(tmp_path, lambda: x.float(), task="statistics", level="L1", risk_level="ALL",
                          statistics={"summary_mode": "md5"})
    record = doc["data"]["Tensor.float.0.forward"]["input_args"][0]
    assert record["md5"] == f"{zlib.crc32(x.float().numpy().tobytes()):08x}"
    assert list(record)[-2:] == ["requires_grad", "md5"]
    assert not (rank_dir / "dump_tensor_data").exists()


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(torch.tanh(self.fc(x)))


def test_mix_records_the_nesting_in_construct_json_and_stacks_on_request(tmp_path):
    torch.manual_seed(0)
    model = Mlp()
    x = torch.randn(2, 4)
    doc, rank_dir = _dump(tmp_path, lambda: model(x).sum().backward(), task="statistics", level="mix",
                          model=model, stack=True)
    construct = json.loads((rank_dir / "construct.json").read_text())
    assert construct["Functional.linear.0.forward"] == "Module.fc.Linear.forward.0"
    assert construct["Torch.tanh.0.forward"] is None
    assert construct["Module.act.0.Linear.forward.0"] == "Module.act.Sequential.forward.0"
    assert construct["Functional.relu.0.forward"] == "Module.act.1.ReLU.forward.0"
    assert construct["Functional.relu.0.backward"] == "Module.act.1.ReLU.backward.0"
    assert construct["Module.act.1.ReLU.backward.0"] == "Module.act.Sequential.backward.0"
    assert {"Module.fc.Linear.parameters_grad.0", "Tensor.sum.0.backward"} <= set(doc["data"])
    raw = json.loads((rank_dir / "stack.json").read_text())  # grouped: {"0": [[entries], [frames]], ...}
    assert list(raw) == [str(i) for i in range(len(raw))] and all(len(v) == 2 for v in raw.values())
    assert sum(len(names) for names, _ in raw.values()) == len({n for names, _ in raw.values() for n in names})
    stacks = load_dump(rank_dir)[(0, None)].stack()
    assert set(stacks) == {n for n in doc["data"] if n.endswith("forward") or ".forward." in n}
    frame = next(f for f in stacks["Torch.tanh.0.forward"] if "test_dump_format.py" in f)
    assert frame.startswith(f"File {__file__}, line ") and frame.endswith("self.act(torch.tanh(self.fc(x)))")
    assert validate_dump_json(doc) == []


def test_data_mode_keeps_only_the_asked_roles(tmp_path):
    torch.manual_seed(0)
    model = Mlp()
    doc, _ = _dump(tmp_path, lambda: model(torch.randn(2, 4)).sum().backward(), task="statistics", level="L0",
                   model=model, statistics={"data_mode": ["forward", "input"]})
    assert all(name.endswith((".forward.0",)) for name in doc["data"])
    # modules without parameters too get "parameters": {} (the predecessor writes it for every module)
    assert {tuple(e) for e in doc["data"].values()} == {("input_args", "input_kwargs", "parameters")}
    doc, _ = _dump(tmp_path / "b", lambda: model(torch.randn(2, 4)).sum().backward(), task="statistics",
                   level="L0", model=model, statistics={"data_mode": ["backward"]})
    assert {n.rsplit(".", 2)[-2] if n[-1].isdigit() else "parameters_grad" for n in doc["data"]} == {
        "backward", "parameters_grad"}
