"""Tensors outside the ordinary: complex (by magnitude, nan/inf in either part counted),
sparse (on their stored values), empty, and outputs nested deeper than a few levels."""
import math

import numpy as np
import pytest
import torch
from torch import nn

from msprobe_engine.collect import flatten
from msprobe_engine.frameworks.torch import backend
from msprobe_engine.monitor import Monitor
from msprobe_engine.stats import finalize


def stats_of(*tensors):
    return {k: v.tolist() for k, v in finalize(backend.to_host(backend.partial_stats(list(tensors)))).items()}


def test_complex_tensors_are_measured_by_magnitude():
    s = stats_of(torch.tensor([3 - 4j, 0 + 1j]))
    assert (s["min"][0], s["max"][0], s["mean"][0]) == (1.0, 5.0, 3.0)
    assert s["norm"][0] == pytest.approx(math.sqrt(26))


@pytest.mark.parametrize("value, nans, infs", [
    (complex(1, math.nan), 1, 0), (complex(math.nan, 1), 1, 0),
    (complex(1, math.inf), 0, 1), (complex(-math.inf, 2), 0, 1)])
def test_a_non_finite_part_of_a_complex_value_is_counted(value, nans, infs):
    s = stats_of(torch.tensor([1 + 1j, value, 2j]))
    assert (s["nan_count"][0], s["inf_count"][0]) == (nans, infs)


def test_sparse_tensors_are_measured_on_their_values_and_ordinary_ones_unchanged():
    dense = torch.tensor([[0.0, -2.0, 0.0], [1.5, 0.0, 4.0]])
    values = torch.tensor([-2.0, 1.5, 4.0])
    for sparse in (dense.to_sparse(), dense.to_sparse_csr(), dense.to_sparse().coalesce() * 1):
        np.testing.assert_equal(stats_of(sparse), stats_of(values))  # nan (zero_frac not taken) equals nan
    assert stats_of(dense)["norm"] == stats_of(values)["norm"]  # zeros add nothing to the norm
    assert stats_of(torch.zeros(0))["norm"] == [0.0] and math.isnan(stats_of(torch.zeros(0))["min"][0])


class Odd(nn.Module):
    """Outputs a complex, a sparse and a deeply nested tensor."""

    def forward(self, x):
        y = x * 2
        deep = y
        for _ in range(6):
            deep = [deep]
        return {"deep": deep, "sparse": y.to_sparse(), "complex": torch.complex(y, y)}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.odd = Odd()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(self.odd(x)["deep"][0][0][0][0][0][0])


def test_odd_outputs_are_measured_through_the_hooks_even_in_strict_mode(tmp_path):
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    monitor = Monitor({"output_dir": str(tmp_path), "sinks": [], "strict": True}).attach(model, optimizer)
    loss = model(torch.randn(2, 4)).sum()
    loss.backward()
    optimizer.step()
    record = monitor.step_end(loss)
    monitor.close()
    tags = {tag for tag in record.metrics if tag.startswith("actv/odd/") and tag.endswith("/norm")}
    assert tags == {"actv/odd/output.deep.0.0.0.0.0.0/norm", "actv/odd/output.sparse/norm",
                    "actv/odd/output.complex/norm"}
    assert record.metrics["actv/odd/output.complex/norm"] == pytest.approx(
        math.sqrt(2) * record.metrics["actv/odd/output.sparse/norm"])


def test_nesting_past_the_limit_is_counted_not_walked():
    flatten.too_deep.clear()
    value: object = "leaf"
    for _ in range(flatten.MAX_DEPTH + 5):
        value = [value, 1.0]
    value = [value, torch.ones(1)]
    found = list(flatten.iter_tensors(value, "output", lambda v: isinstance(v, torch.Tensor)))
    assert [role for role, _ in found] == ["output.1"]
    assert flatten.too_deep["output"] == 1
    looped: list = []
    looped.append(looped)  # a list that holds itself: stops at the limit too
    assert list(flatten.iter_tensors(looped, "input", lambda v: False)) == []
    assert flatten.too_deep["input"] == 1
