"""dump.json schema and dump-directory reader, on the reference examples and broken variants."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dumpgen import stat_record, write_dump_json
from msprobe_engine.dump import (DumpError, iter_dump_tensors, iter_tensors, load_dump, parse_entry_name,
                                 validate_dump_json)

FIXTURES = Path(__file__).parent / "fixtures"


def _doc(name: str) -> dict:
    return json.loads(next((FIXTURES / name).glob("step0/rank*/dump.json")).read_text())


@pytest.mark.parametrize("name,key,framework,entries,tensors", [
    ("pytorch_L0", (0, 0), "pytorch", 3, 8),
    ("pytorch_L1", (0, None), "pytorch", 2, 4),
    ("mindspore_L0", (0, 0), "mindspore", 3, 8),
])
def test_reference_examples_load_and_validate(name, key, framework, entries, tensors):
    dumps = load_dump(FIXTURES / name)
    assert list(dumps) == [key]
    dump = dumps[key]
    assert (dump.framework, dump.task, dump.problems) == (framework, "tensor", [])
    assert len(dump.data) == entries
    assert len(list(iter_dump_tensors({"data": dump.data}))) == tensors
    assert validate_dump_json(_doc(name)) == []


def test_tensor_roles_and_paths_of_l0_example():
    data = _doc("pytorch_L0")["data"]
    labels = {n: [r.label for r in iter_tensors(n, e)] for n, e in data.items()}
    assert labels == {
        "Module.conv2.Conv2d.forward.0": ["input_args.0", "parameters.weight", "parameters.bias", "output.0"],
        "Module.conv2.Conv2d.parameters_grad": ["parameters_grad.weight.0", "parameters_grad.bias.0"],
        "Module.conv2.Conv2d.backward.0": ["input.0", "output.0"],
    }
    ref = next(iter_tensors("Module.conv2.Conv2d.backward.0", data["Module.conv2.Conv2d.backward.0"]))
    assert ref.is_input and ref.stat("Norm") == pytest.approx(0.020567523315548897)


def test_mindspore_records_have_no_requires_grad():
    data = _doc("mindspore_L0")["data"]
    assert all("requires_grad" not in r.record for n, e in data.items() for r in iter_tensors(n, e))


@pytest.mark.parametrize("name,parsed", [
    ("Module.conv2.Conv2d.forward.0", ("Module", "conv2.Conv2d", "forward", 0, "Module.conv2.Conv2d.forward")),
    ("Module.layers.10.mlp.MLP.backward.3", ("Module", "layers.10.mlp.MLP", "backward", 3,
                                             "Module.layers.10.mlp.MLP.backward")),
    ("Cell.conv2.Conv2d.parameters_grad", ("Cell", "conv2.Conv2d", "parameters_grad", None,
                                           "Cell.conv2.Conv2d.parameters_grad")),
    ("Functional.relu.12.forward", ("Functional", "relu", "forward", 12, "Functional.relu.forward")),
    ("Distributed.all_gather.0.backward", ("Distributed", "all_gather", "backward", 0,
                                           "Distributed.all_gather.backward")),
    ("Aten.add.Tensor.3.forward", ("Aten", "add.Tensor", "forward", 3, "Aten.add.Tensor.forward")),
])
def test_parse_entry_name(name, parsed):
    p = parse_entry_name(name)
    assert (p.prefix, p.target, p.phase, p.counter, p.key) == parsed


def test_unknown_entry_name_is_a_problem():
    assert parse_entry_name("relu") is None
    doc = _doc("pytorch_L1")
    doc["data"]["relu_forward"] = {}
    assert validate_dump_json(doc) == ["data['relu_forward']: unrecognised entry name (expected Module/Cell."
                                       "<path>.<Class>.forward|backward.<n>, Module/Cell.<path>.<Class>."
                                       "parameters_grad or <Prefix>.<api>.<n>.forward|backward)"]


def test_precise_problems_for_broken_records():
    doc = _doc("pytorch_L0")
    fwd = doc["data"]["Module.conv2.Conv2d.forward.0"]
    del fwd["output"][0]["Max"]
    fwd["input_args"][0]["shape"] = "8x16"
    fwd["parameters"]["bias"]["requires_grad"] = "yes"
    del doc["data"]["Module.conv2.Conv2d.parameters_grad"]["weight"][0]["data_name"]
    doc["data"]["Module.conv2.Conv2d.backward.0"]["input"] = {"0": None}
    doc["level"] = "L9"
    del doc["task"]
    doc["task"] = "tensor"
    assert validate_dump_json(doc) == [
        "'level': 'L9' is not one of L0, L1, L2, mix",
        "data['Module.conv2.Conv2d.forward.0'].input_args[0]: 'shape' must be a list of non-negative integers, "
        "got '8x16'",
        "data['Module.conv2.Conv2d.forward.0'].parameters['bias']: 'requires_grad' must be true/false, got 'yes'",
        "data['Module.conv2.Conv2d.forward.0'].output[0]: missing 'Max'",
        "data['Module.conv2.Conv2d.parameters_grad']['weight'][0]: missing 'data_name' (task is 'tensor')",
        "data['Module.conv2.Conv2d.backward.0'].input: expected a list, got dict",
    ]


def test_top_level_problems():
    assert validate_dump_json([]) == ["top level: expected an object, got list"]
    assert validate_dump_json({"task": 1, "level": "L0", "framework": "jax", "data": {}}) == [
        "'task': wrong type int", "missing top-level key 'dump_data_dir'",
        "'framework': 'jax' is not one of pytorch, mindspore"]


def test_nested_args_non_tensors_nan_and_md5(tmp_path):
    entry = {
        "input_args": [[stat_record(1.0, 0.0, 0.5, 1.0), None, {"type": "int", "value": 3}],
                       {"type": "slice", "value": [0, 3, None]}],
        "input_kwargs": {"mask": stat_record(True, False, None, None, dtype="torch.bool"),
                         "opts": {"scale": stat_record(float("nan"), float("-inf"), float("nan"), float("inf"),
                                                       md5="1a2b3c4d")}},
        "output": [stat_record(2.0, 1.0, 1.5, 3.0)],
    }
    rank_dir = write_dump_json(tmp_path / "step0" / "rank0", {"Torch.where.0.forward": entry})
    dump = load_dump(tmp_path)[(0, 0)]
    refs = list(iter_tensors("Torch.where.0.forward", dump.data["Torch.where.0.forward"]))
    assert [r.label for r in refs] == ["input_args.0.0", "input_kwargs.mask", "input_kwargs.opts.scale", "output.0"]
    assert refs[1].stat("Max") == 1.0 and refs[1].stat("Mean") is None
    assert math.isnan(refs[2].stat("Max")) and refs[2].stat("Norm") == math.inf
    bad = json.loads((rank_dir / "dump.json").read_text())
    bad["data"]["Torch.where.0.forward"]["output"][0]["md5"] = "xyz"
    bad["data"]["Torch.where.0.forward"]["output"][0]["Mean"] = "0.5"
    assert validate_dump_json(bad) == [
        "data['Torch.where.0.forward'].output[0]: 'Mean' must be a number or null, got '0.5'",
        "data['Torch.where.0.forward'].output[0]: 'md5' must be an 8-digit hex CRC-32, got 'xyz'"]


def test_layout_root_step_and_rank_dirs(tmp_path):
    for step, rank in [(0, 0), (0, 1), (2, 0), (10, 1)]:
        write_dump_json(tmp_path / f"step{step}" / f"rank{rank}", {})
    assert list(load_dump(tmp_path)) == [(0, 0), (0, 1), (2, 0), (10, 1)]
    assert list(load_dump(tmp_path / "step2")) == [(2, 0)]
    assert list(load_dump(tmp_path / "step10" / "rank1")) == [(10, 1)]


def test_structural_errors_name_the_file(tmp_path):
    with pytest.raises(DumpError, match="no such directory"):
        load_dump(tmp_path / "missing")
    (tmp_path / "step0" / "rank0").mkdir(parents=True)
    with pytest.raises(DumpError, match="rank0: no dump.json in this rank directory"):
        load_dump(tmp_path / "step0")
    file = tmp_path / "step0" / "rank0" / "dump.json"
    file.write_text('{"task": "tensor",\n "data": {,}}')
    with pytest.raises(DumpError, match=rf"{file}: invalid JSON at line 2, column 11"):
        load_dump(tmp_path)
    file.write_text('{"task": "tensor", "level": "L1", "framework": "pytorch", "dump_data_dir": null, '
                    '"data": {"Functional.relu.0.forward": {"output": [{"type": "torch.Tensor"}]}}}')
    with pytest.raises(DumpError) as err:
        load_dump(tmp_path)
    assert f"{file}: 7 problem(s)" in str(err.value)
    assert "data['Functional.relu.0.forward'].output[0]: missing 'Norm'" in str(err.value)
    loose = load_dump(tmp_path, strict=False)[(0, 0)]
    assert len(loose.problems) == 7 and loose.problems[0].startswith(str(file))


def _tensor_dump(tmp_path: Path, data_name: str) -> tuple:
    rec = stat_record(1.0, 0.0, 0.5, 1.0, data_name=data_name)
    rank_dir = write_dump_json(tmp_path / "dump" / "step0" / "rank0", {"Torch.add.0.forward": {"output": [rec]}},
                               task="tensor")
    (rank_dir / "dump_tensor_data").mkdir(exist_ok=True)
    dump = load_dump(rank_dir)[(0, 0)]
    ref = next(iter_tensors("Torch.add.0.forward", dump.data["Torch.add.0.forward"]))
    return dump, ref, rank_dir / "dump_tensor_data"


def test_tensor_loading_pt_npy_and_bfloat16(tmp_path):
    dump, ref, tdir = _tensor_dump(tmp_path, "Torch.add.0.forward.output.0.pt")
    torch.save(torch.tensor([[1.5, 2.0]], dtype=torch.bfloat16), tdir / ref.record["data_name"])
    array = dump.load_tensor(ref)
    assert array.dtype == np.float32 and array.tolist() == [[1.5, 2.0]]
    dump, ref, tdir = _tensor_dump(tmp_path / "n", "x.npy")
    np.save(tdir / "x.npy", np.arange(4, dtype=np.int64))
    assert dump.load_tensor(ref).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("data_name,message", [
    ("../dump.json", "must be a plain name inside dump_tensor_data/"),
    ("/etc/passwd", "must be a plain name inside dump_tensor_data/"),
    ("link.pt", "resolves outside dump_tensor_data/"),
    ("absent.pt", "tensor file .*absent.pt is missing"),
])
def test_tensor_paths_must_stay_inside_dump_tensor_data(tmp_path, data_name, message):
    dump, ref, tdir = _tensor_dump(tmp_path, data_name)
    outside = tmp_path / "secret.pt"
    torch.save(torch.zeros(2), outside)
    (tdir / "link.pt").symlink_to(outside)
    with pytest.raises(DumpError, match=message) as err:
        dump.load_tensor(ref)
    assert "data['Torch.add.0.forward'].output.0" in str(err.value)


def test_non_tensor_pickle_is_refused(tmp_path):
    dump, ref, tdir = _tensor_dump(tmp_path, "obj.pt")
    torch.save({"a": torch.zeros(1)}, tdir / "obj.pt")
    with pytest.raises(DumpError, match="holds a dict, not a tensor"):
        dump.load_tensor(ref)
    shutil.copy(Path(__file__), tdir / "obj.pt")
    with pytest.raises(DumpError, match="cannot load tensor"):
        dump.load_tensor(ref)


def test_every_rank_directory_layout_and_both_stack_forms_are_read(tmp_path):
    rec = stat_record(1.0, 0.0, 0.5, 1.0)
    entry = {"input_args": [rec], "input_kwargs": {}, "output": [rec]}
    write_dump_json(tmp_path / "ours" / "step0" / "proc4242", {"Torch.add.0.forward": entry})   # 26.2
    write_dump_json(tmp_path / "ours" / "step1" / "proc4242", {"Torch.add.0.forward": entry})
    write_dump_json(tmp_path / "old" / "step0" / "rank", {"Torch.add.0.forward": entry})       # 1.x
    write_dump_json(tmp_path / "dist" / "step0" / "rank3", {"Torch.add.0.forward": entry})     # distributed
    assert sorted(load_dump(tmp_path / "ours")) == [(0, None), (1, None)]
    assert list(load_dump(tmp_path / "old")) == [(0, None)] and list(load_dump(tmp_path / "dist")) == [(0, 3)]
    assert list(load_dump(tmp_path / "ours" / "step1")) == [(1, None)]
    grouped = {"0": [["Torch.add.0.forward", "Torch.mul.0.forward"], ["File a.py, line 1, in f, \n x"]],
               "1": [["Torch.sub.0.forward"], ["File b.py, line 2, in g, \n y"]]}
    (tmp_path / "ours" / "step0" / "proc4242" / "stack.json").write_text(json.dumps(grouped))
    (tmp_path / "old" / "step0" / "rank" / "stack.json").write_text(json.dumps({"Torch.add.0.forward": ["f"]}))
    stack = load_dump(tmp_path / "ours")[(0, None)].stack()
    assert stack == {"Torch.add.0.forward": ["File a.py, line 1, in f, \n x"],
                     "Torch.mul.0.forward": ["File a.py, line 1, in f, \n x"],
                     "Torch.sub.0.forward": ["File b.py, line 2, in g, \n y"]}
    assert load_dump(tmp_path / "old")[(0, None)].stack() == {"Torch.add.0.forward": ["f"]}
    (tmp_path / "empty" / "step0" / "procs").mkdir(parents=True)  # not a rank directory name
    with pytest.raises(DumpError, match="no dump.json here and no step\\*/rank\\*/, step\\*/proc\\*/"):
        load_dump(tmp_path / "empty")
