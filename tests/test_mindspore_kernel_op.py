"""The C kernel as MindSpore custom operators inside a GRAPH_MODE graph (real MindSpore 2.10, CPU).

Their rows are compared with MindSpore's own in-graph reductions (`graph_rows.tensor_row` without
the kernel, the rows PyNative's backend gives) and with numpy on the host: every kernel dtype,
sizes from 1 to past the kernel's blocks, a nan and an inf, zeros counted or not, and an update's
difference never written.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mindspore import Parameter, Tensor, nn, ops  # noqa: E402

from msprobe_engine.frameworks.mindspore import kernel_op  # noqa: E402
from msprobe_engine.frameworks.mindspore.graph_rows import buffer_rows, slot_rows, tensor_row, write_tensor  # noqa: E402

ms.set_device("CPU")


class BothWays(nn.Cell):
    """The rows of its inputs by the operator (its flag a Parameter, as the taps') and by
    MindSpore's reductions, in one graph."""

    def __init__(self, count_zeros: bool) -> None:
        super().__init__()
        self.count_zeros = count_zeros
        self.op = kernel_op.rows_op(count_zeros)
        self.on = Parameter(Tensor(True), name="on", requires_grad=False)

    def construct(self, *tensors):
        mine = ops.stack([tensor_row(t, self.count_zeros) for t in tensors])
        return self.op(self.on, *tensors), mine


class Differences(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.op = kernel_op.diff_rows_op(True)
        self.on = Parameter(Tensor(True), name="on", requires_grad=False)

    def construct(self, a, b):
        return self.op(self.on, a, b), ops.stack([tensor_row(a - b, True)])


class Writes(nn.Cell):
    """A graph tap's writes of its inputs into slots of a statistics Parameter: the first three
    into slots 0, 2, 0 (a Cell called twice: merged), the fourth into slot 3."""

    def __init__(self, kernel, slots: int = 4) -> None:
        super().__init__()
        self.buffer = Parameter(Tensor(buffer_rows(slots)), name="buffer", requires_grad=False)
        self.on = Parameter(Tensor(True), name="on", requires_grad=False)
        self.kernel = kernel

    def construct(self, a, b, c, d):
        out = a
        for slot, x in ((0, a), (2, b), (0, c), (3, d)):
            out = ops.depend(out, write_tensor(self.buffer, slot_rows(slot, 4), x, True, self.kernel, self.on))
        return out


@pytest.fixture(autouse=True)
def graph_mode():
    assert kernel_op.usable(()), kernel_op.disabled_reason
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=ms.PYNATIVE_MODE)


def inputs() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(n).astype(np.float32) for n in (1, 37, 512, 5000)]
    values[2][:100] = 0.0
    poisoned = rng.standard_normal((20, 30)).astype(np.float32)
    poisoned[3, 4], poisoned[7, 1] = np.nan, np.inf
    infinite = np.array([1.0, -np.inf, 2.0, 0.0], np.float32)
    return [*values, poisoned, infinite, rng.standard_normal(777).astype(np.float16),
            rng.standard_normal((9, 9)), rng.integers(-50, 50, 300).astype(np.int64),
            rng.integers(0, 3, 40).astype(np.int32)]


@pytest.mark.parametrize("count_zeros", [False, True])
def test_the_operators_rows_are_mindspores_in_graph_rows(count_zeros):
    arrays = inputs()
    got, mine = (out.asnumpy() for out in BothWays(count_zeros)(*[Tensor(a) for a in arrays]))
    assert got.shape == (len(arrays), 8) and got.dtype == np.float64
    exact = [0, 1, 4, 5, 6, 7] if count_zeros else [0, 1, 4, 5, 7]
    np.testing.assert_array_equal(got[:, exact], mine[:, exact])
    np.testing.assert_allclose(got[:, 2:4], mine[:, 2:4], rtol=1e-5)
    assert np.isnan(got[:, 6]).all() != count_zeros
    for row, array in zip(got, arrays):  # against numpy, exactly where it can be
        finite = array[np.isfinite(array)].astype(np.float64)
        assert row[4:6].tolist() == [np.isnan(array).sum(), np.isinf(array).sum()] and row[7] == array.size
        if not np.isnan(array).any():
            assert row[0] == array.min() and row[1] == array.max()
        if np.isfinite(array).all():
            np.testing.assert_allclose(row[3], (finite * finite).sum(), rtol=1e-12)  # squares summed in float64
    assert np.isnan(got[4, :2]).all() and got[5, :2].tolist() == [-np.inf, 2.0]  # a nan's min/max; -inf kept
    if count_zeros:
        assert got[2, 6] == 100 and got[5, 6] == 1


class BFloat16(BothWays):
    """Its input cast to bfloat16 inside the graph (numpy has no bfloat16), then both ways."""

    def construct(self, x):
        y = x.astype(ms.bfloat16)
        return self.op(self.on, y), ops.stack([tensor_row(y, self.count_zeros)])


def test_a_bfloat16_tensor_made_in_the_graph_is_read_as_bfloat16():
    values = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    values[:10] = 0.0
    got, mine = (out.asnumpy() for out in BFloat16(True)(Tensor(values)))
    np.testing.assert_array_equal(got[:, [0, 1, 4, 5, 6, 7]], mine[:, [0, 1, 4, 5, 6, 7]])
    np.testing.assert_allclose(got[:, 2:4], mine[:, 2:4], rtol=1e-5)
    assert got[0, 1] != values.max() and got[0, 6] == 10  # bfloat16's rounded max, not float32's


def test_the_difference_operator_gives_the_rows_of_the_difference_without_writing_it():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, 33)).astype(np.float32)
    b = a.copy()
    b[:8] -= 1e-3
    got, mine = (out.asnumpy() for out in Differences()(Tensor(a), Tensor(b)))
    np.testing.assert_array_equal(got[:, [0, 1, 4, 5, 6, 7]], mine[:, [0, 1, 4, 5, 6, 7]])
    np.testing.assert_allclose(got[:, 2:4], mine[:, 2:4], rtol=1e-5)
    assert got[0, 6] == 56 * 33  # the unchanged rows' differences are zeros


def test_with_the_flag_false_the_rows_are_nan_and_true_again_they_are_measured():
    """An unmonitored step: the host sets the flag Parameter, the compiled graph is not compiled again."""
    arrays = inputs()[:3]
    both, diff = BothWays(False), Differences()
    want = both(*[Tensor(a) for a in arrays])[0].asnumpy()
    for cell in (both, diff):
        ops.assign(cell.on, Tensor(False))
    assert np.isnan(both(*[Tensor(a) for a in arrays])[0].asnumpy()).all()
    assert np.isnan(diff(Tensor(arrays[2]), Tensor(arrays[2]))[0].asnumpy()).all()
    ops.assign(both.on, Tensor(True))
    np.testing.assert_array_equal(both(*[Tensor(a) for a in arrays])[0].asnumpy(), want)


def test_a_taps_write_by_the_operator_merges_and_orders_as_mindspores_write():
    """Rows merged where a slot is written twice (one with a nan) and the meta columns (dtype,
    shape) as `graph_rows.write`'s; the order column each slot's first write in the writes' order
    and the counter row their count (this graph's `write`s, not chained by data, all read the
    counter before any of them wrote it: stamps of 1); with the flag false the Parameter is left
    as it was."""
    arrays = inputs()
    values = [Tensor(arrays[3]), Tensor(arrays[6]), Tensor(arrays[4]), Tensor(arrays[8])]
    by_kernel, by_mindspore = Writes(kernel_op.write_op(True)), Writes(None)
    for cell in (by_kernel, by_mindspore):
        cell(*values)
    got, want = by_kernel.buffer.asnumpy(), by_mindspore.buffer.asnumpy()
    exact = [0, 1, 4, 5, 6, 7, *range(9, got.shape[1])]
    np.testing.assert_array_equal(got[:-1, exact], want[:-1, exact])
    np.testing.assert_allclose(got[:-1, 2:4], want[:-1, 2:4], rtol=1e-5)
    assert np.isnan(got[0, :2]).all() and got[0, 7] == 5000 + 600 and got[0, 9:11].tolist() == [0, 1]
    assert got[:-1, 8].tolist() == [1, np.inf, 2, 4] and (got[-1] == 4).all()  # slot 0: its first write's
    ops.assign(by_kernel.on, Tensor(False))
    by_kernel(*values)
    np.testing.assert_array_equal(by_kernel.buffer.asnumpy(), got)


def test_only_what_the_kernel_reads_is_given_to_it():
    assert kernel_op.usable([Tensor(np.ones(3, np.float32)), Tensor(np.ones(2, np.int64))])
    assert not kernel_op.usable([Tensor(np.ones(3, np.float32)), Tensor(np.ones(3, np.bool_))])
    assert not kernel_op.usable([Tensor(np.ones((0, 3), np.float32))])  # empty: MindSpore's reductions
    assert not kernel_op.usable([Tensor(np.ones(3, np.int64))], differences=True)
