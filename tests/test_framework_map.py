"""`analysis.framework_map`: MindSpore entry names in PyTorch's terms (no framework imported;
the two frameworks' dumps compared end to end: tests/test_mindspore_vs_torch.py)."""
from __future__ import annotations

import pytest

from msprobe_engine.analysis.framework_map import canonical_label, canonical_name, canonical_names


@pytest.mark.parametrize("name, canonical", [
    ("Cell.layers.0.Dense.forward.3", "Module.layers.0.Linear.forward.3"),
    ("Cell.blocks.CellList.backward.0", "Module.blocks.ModuleList.backward.0"),
    ("Cell.fc.Dense.parameters_grad", "Module.fc.Linear.parameters_grad"),
    ("Functional.dense.2.forward", "Functional.linear.2.forward"),
    ("Functional.matmul.0.forward", "Torch.matmul.0.forward"),
    ("MintFunctional.gelu.1.backward", "Functional.gelu.1.backward"),
    ("MintDistributed.all_reduce.0.forward", "Distributed.all_reduce.0.forward"),
    ("Primitive.matmul.MatMul.0.forward", "Primitive.matmul.MatMul.0.forward"),
])
def test_mindspore_names_in_pytorch_terms(name, canonical):
    assert canonical_name(name, "mindspore") == canonical
    assert canonical_name(canonical, "pytorch") == canonical  # PyTorch names are the canonical ones


def test_parameter_labels_and_collisions():
    assert canonical_label("parameters.gamma", "mindspore") == "parameters.weight"
    assert canonical_label("parameters_grad.beta.0", "mindspore") == "parameters_grad.bias.0"
    assert canonical_label("parameters.gamma", "pytorch") == "parameters.gamma"
    assert canonical_label("input_args.0", "mindspore") == "input_args.0"
    assert canonical_names(["Functional.relu.0.forward", "MintFunctional.relu.0.forward"], "mindspore") == [
        "Functional.relu.0.forward", "MintFunctional.relu.0.forward"]  # a collision keeps its own name
