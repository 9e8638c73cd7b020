"""`graph`: hierarchy, node-by-node comparison, first divergence, overflow marks, batch builds,
the plugin's .vis.db file (read back with sqlite3 as the plugin's queries do), bad input."""
import json
import shutil
import sqlite3
import subprocess
import sys

import pytest

from graph_helpers import PERTURBED, dump
from msprobe_engine.analysis.graph import build_graph, build_graphs, write_outputs
from msprobe_engine.dump import find_rank_dirs
from msprobe_engine.analysis.graph.model import ERROR, PASS, ROOT, WARNING
from msprobe_engine.cli import main
from msprobe_engine.dump import load_dump


def _only(path):
    (graph,) = [build_graph(d) for d in load_dump(path).values()]
    return graph


def _db_rows(path, source="NPU"):
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    try:
        return {r["node_name"]: dict(r) for r in conn.execute("SELECT * FROM tb_nodes WHERE data_source = ?",
                                                              (source,))}
    finally:
        conn.close()


@pytest.fixture(scope="module")
def l0_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("l0")
    return dump(root / "ref", "L0"), dump(root / "target", "L0", gain=3.0)


def test_the_hierarchy_follows_construct_json(l0_pair):
    graph = _only(l0_pair[0])
    nodes = graph.nodes
    assert nodes["Module.blocks.1.fc.Linear.forward.0"].parent == "Module.blocks.1.Block.forward.0"
    assert nodes["Module.blocks.1.Block.forward.0"].parent == ROOT
    assert graph.ancestors(PERTURBED) == [ROOT, "Module.blocks.1.Block.forward.0"]
    assert nodes["Module.blocks.1.fc.Linear.backward.0"].parent == "Module.blocks.1.Block.backward.0"
    # parameter gradients go under their module's (last) backward call
    assert nodes["Module.blocks.0.fc.Linear.parameters_grad.0"].parent == "Module.blocks.0.fc.Linear.backward.0"
    assert nodes["Module.blocks.0.fc.Linear.parameters_grad.0"].outputs  # the weight and bias gradients
    # children in execution order: fc, act, scale inside a block
    assert nodes["Module.blocks.0.Block.forward.0"].children == [
        "Module.blocks.0.fc.Linear.forward.0", "Module.blocks.0.act.ReLU.forward.0",
        "Module.blocks.0.scale.Scale.forward.0"]
    assert set(nodes[PERTURBED].outputs) == {f"{PERTURBED}.output.0"}
    assert {n.name for n in graph.walk()} == set(nodes)  # every node reachable from the root
    assert graph.notes == []


def test_the_perturbed_layer_is_the_first_divergence_and_its_parents_contain_it(l0_pair, tmp_path):
    ref, target = l0_pair
    result = build_graphs(target, ref)
    (graph,) = result.targets
    assert graph.first_divergence == PERTURBED
    bad = graph.nodes[PERTURBED]
    assert bad.precision == ERROR and bad.first_divergence and bad.matched == PERTURBED
    record = bad.outputs[f"{PERTURBED}.output.0"]
    assert record["Result"] == "error" and record["NormRelativeErr"].startswith("200.0000")  # x3: +200 %
    for parent in (ROOT, "Module.blocks.1.Block.forward.0"):
        assert graph.nodes[parent].contains_divergence and graph.nodes[parent].subtree_precision == ERROR
    assert not graph.nodes["Module.blocks.0.Block.forward.0"].contains_divergence
    assert graph.nodes["Module.blocks.0.Block.forward.0"].subtree_precision == PASS
    assert graph.nodes["Module.blocks.1.fc.Linear.forward.0"].precision == PASS  # before the perturbation
    assert result.structures[0].same

    files = write_outputs(result, tmp_path / "out")
    rows = _db_rows(files["vis_db"])
    assert rows[PERTURBED]["precision_index"] == 1 and rows["Module.blocks.1.Block.forward.0"]["precision_index"] == 1
    assert rows["Module.blocks.0.Block.forward.0"]["precision_index"] == 0
    assert json.loads(rows[PERTURBED]["matched_node_link"]) == [ROOT, "Module.blocks.1.Block.forward.0", PERTURBED]
    assert json.loads(rows["Module.blocks.1.Block.forward.0"]["sub_nodes"])[-1] == PERTURBED
    assert set(_db_rows(files["vis_db"], "Bench")) == set(rows)
    summary = json.loads(files["summary"].read_text())["graphs"][0]
    assert summary["first_divergence"]["node"] == PERTURBED
    assert summary["first_divergence"]["ancestors"] == ["Module.blocks.1.Block.forward.0"]
    page = files["html"].read_text()
    assert PERTURBED in page and "<script src" not in page and "<link" not in page  # self-contained


def test_tensor_dumps_compare_tensors_per_node(tmp_path):
    ref, target = dump(tmp_path / "ref", "L0", task="tensor"), dump(tmp_path / "target", "L0", task="tensor", gain=3.0)
    result = build_graphs(target, ref)
    graph = result.targets[0]
    # tensors are judged by cosine and error ratios (as compare does): a pure x3 keeps the cosine at 1,
    # so the layer is a warning, and the block, which adds its input back, is the first error
    assert result.mode == "tensor" and graph.first_divergence == "Module.blocks.1.Block.forward.0"
    assert graph.nodes[PERTURBED].precision == WARNING
    record = graph.nodes[PERTURBED].outputs[f"{PERTURBED}.output.0"]
    assert record["Cosine"] == pytest.approx(1.0) and record["MaxRelativeErr"] == pytest.approx(2.0)
    assert record["Result"] == "warning"
    assert graph.nodes["Module.blocks.1.Block.forward.0"].outputs["Module.blocks.1.Block.forward.0.output.0"][
        "Cosine"] < 0.99
    rows = _db_rows(write_outputs(result, tmp_path / "out")["vis_db"])
    conn = sqlite3.connect(next((tmp_path / "out").glob("*.vis.db")))
    assert conn.execute("SELECT task FROM tb_config").fetchone() == ("all",)
    conn.close()
    assert rows[PERTURBED]["precision_index"] == 0.5


def test_at_level_mix_the_first_divergence_is_the_api_call_inside_the_layer(tmp_path):
    ref, target = dump(tmp_path / "ref", "mix"), dump(tmp_path / "target", "mix", gain=3.0)
    (graph,) = build_graphs(target, ref).targets
    first = graph.first_divergence
    assert first.startswith("Tensor.__mul__.") and graph.nodes[first].kind == 1  # `x * gain`, named as the predecessor does
    assert graph.ancestors(first)[-1] == PERTURBED and graph.nodes[PERTURBED].contains_divergence


def test_an_l1_dump_gives_a_flat_graph_and_says_why(tmp_path, capsys):
    root = dump(tmp_path / "l1", "L1")
    graph = _only(root)
    assert len(graph.notes) == 1 and "L0 or mix" in graph.notes[0] and "construct.json" in graph.notes[0]
    assert len(graph.nodes) > 5 and all(n.parent == ROOT for n in graph.nodes.values() if n.name != ROOT)
    assert main(["graph", "-tp", str(root), "-o", str(tmp_path / "out")]) == 0
    assert "L0 or mix" in capsys.readouterr().out


def test_two_different_models_report_the_structural_difference(tmp_path, capsys):
    ref, target = dump(tmp_path / "two", "L0", blocks=2), dump(tmp_path / "three", "L0", blocks=3)
    result = build_graphs(target, ref)
    structure = result.structures[0]
    assert not structure.same and structure.only_reference == []
    assert "Module.blocks.2.Block.forward.0" in structure.only_target
    graph = result.targets[0]
    assert graph.nodes["Module.blocks.2.Block.forward.0"].class_name == "unmatched"
    assert main(["graph", "-tp", str(target), "-gp", str(ref), "-o", str(tmp_path / "out")]) == 0
    assert "structure differs" in capsys.readouterr().out
    rows = _db_rows(next((tmp_path / "out").glob("*.vis.db")))
    assert json.loads(rows["Module.blocks.2.Block.forward.0"]["matched_node_link"]) == []


def test_steps_and_ranks_are_built_in_one_file_and_one_rank_pairs_with_each_of_two(tmp_path):
    ref = dump(tmp_path / "ref", "L0", steps=2)
    files = write_outputs(build_graphs(ref), tmp_path / "out")
    conn = sqlite3.connect(files["vis_db"])
    (steps, ranks), = conn.execute("SELECT step_list, rank_list FROM tb_config").fetchall()
    assert json.loads(steps) == [0, 1] and json.loads(ranks) == [0]
    assert {s for s, in conn.execute("SELECT DISTINCT step FROM tb_nodes")} == {0, 1}
    conn.close()
    # the same model "on two ranks" (its rank directory twice) against the one-rank reference
    two = tmp_path / "two_ranks" / "step0"
    for rank in (0, 1):
        shutil.copytree(find_rank_dirs(ref / "step0")[0], two / f"rank{rank}")
    result = build_graphs(two.parent, ref / "step0")
    assert [(g.step, g.rank) for g in result.targets] == [(0, 0), (0, 1)]
    assert all(g.first_divergence is None for g in result.targets)
    conn = sqlite3.connect(write_outputs(result, tmp_path / "out2")["vis_db"])
    assert {r for r, in conn.execute("SELECT DISTINCT rank FROM tb_nodes WHERE data_source = 'Bench'")} == {0, 1}
    conn.close()


def test_overflow_check_marks_the_nan_layer(tmp_path):
    root = dump(tmp_path / "nan", "L0", gain=float("nan"))
    result = build_graphs(root, overflow_check=True)
    graph = result.targets[0]
    assert graph.nodes[PERTURBED].overflow == "critical"
    assert graph.nodes["Module.blocks.0.Block.forward.0"].overflow is None
    rows = _db_rows(write_outputs(result, tmp_path / "out")["vis_db"])
    assert rows[PERTURBED]["overflow_level"] == "critical"


def test_a_corrupt_construct_json_is_named(tmp_path, capsys):
    root = dump(tmp_path / "d", "L0")
    (find_rank_dirs(root / "step0")[0] / "construct.json").write_text("[1, 2]")
    assert main(["graph", "-tp", str(root), "-o", str(tmp_path / "o")]) == 1
    assert "construct.json: expected an object" in capsys.readouterr().err


def test_cli_errors_name_what_is_missing(tmp_path, capsys):
    assert main(["graph", "-tp", str(tmp_path / "missing"), "-o", str(tmp_path / "o")]) == 1
    assert "missing" in capsys.readouterr().err
    assert main(["graph", str(tmp_path)]) == 1
    assert "incident.json" in capsys.readouterr().err
    assert main(["graph", "-tp", str(tmp_path)]) == 1
    assert "-o" in capsys.readouterr().err


@pytest.mark.slow
def test_an_incident_becomes_the_graph_of_its_step_with_the_culprit_marked(tmp_path):
    from examples.tiny_gpt import inject
    from incident_helpers import config, gpt_and_adam, read_incident, run
    from msprobe_integrations.torch import TorchMonitor

    model, opt = gpt_and_adam()
    monitor = None
    inject(model, "layers.1.mlp.0", lambda: monitor.step, 2, "nan")
    monitor = TorchMonitor(model, opt, config(tmp_path))
    run(model, opt, monitor, 3)
    monitor.close()
    directory = tmp_path / "incidents" / "step2-rank0-non_finite"
    culprit = read_incident(directory)["culprit"]["dump_entry"]
    out = subprocess.run([sys.executable, "-m", "msprobe_engine", "graph", str(directory)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"culprit: {culprit}" in out.stdout
    summary = json.loads((directory / "graph" / "graph_summary.json").read_text())["graphs"][0]
    assert summary["culprit"]["node"] == culprit
    assert summary["dump"].startswith(str(directory / "replay"))  # the replay has the hierarchy
    assert summary["culprit"]["ancestors"][-2:] == ["Module.layers.1.Block.forward.0",
                                                    "Module.layers.1.mlp.Sequential.forward.0"]
    assert summary["overflow"][culprit] == "critical"
