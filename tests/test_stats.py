"""Batched statistics against a plain numpy float64 reference.

Tolerances: min, max and the counts are exact. Sums (mean, norm) are
accumulated in float32 for bf16/fp16/fp32 tensors (chunked for the sum of
squares) and in float64 for tensors batched by size class: rtol 1e-6 up to
SMALL_NUMEL elements, 1e-5 above, plus an atol for means close to zero
scaled by the mean absolute value.
"""
import numpy as np
import pytest
import torch

from msprobe_engine.frameworks.torch import cpu_reduce
from msprobe_engine.frameworks.torch.backend import FOREACH_NUMEL, SMALL_NUMEL, partial_stats
from msprobe_engine.stats import finalize, merge, reference_partial

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 7, 1000, SMALL_NUMEL + 1, FOREACH_NUMEL, FOREACH_NUMEL + 1, 300_000]  # every path and its edges


@pytest.fixture(autouse=True, params=["c_kernel", "torch_path"])
def path(request, monkeypatch):
    """Every test on both CPU paths: the single-pass C kernel (cpu_reduce.py) and the torch path
    (the one accelerators without the fused kernel take)."""
    if request.param == "c_kernel":
        assert cpu_reduce.available(), cpu_reduce.disabled_reason
    monkeypatch.setattr(cpu_reduce, "ENABLED", request.param == "c_kernel")
    return request.param


def reference(t: torch.Tensor) -> np.ndarray:
    values = t.float().numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()
    return reference_partial(values)


def assert_matches(rows: np.ndarray, tensors: list[torch.Tensor]) -> None:
    for row, t in zip(rows, tensors):
        ref = reference(t)
        got, want = finalize(row), finalize(ref)
        for stat in ("min", "max", "nan_count", "inf_count", "numel", "zero_frac"):
            np.testing.assert_array_equal(got[stat], want[stat], err_msg=f"{stat} of {t.dtype}{tuple(t.shape)}")
        rtol = 1e-6 if t.numel() <= SMALL_NUMEL else 1e-5
        abs_mean = float(np.abs(t.double().numpy()).mean()) if t.numel() else 0.0
        np.testing.assert_allclose(got["mean"], want["mean"], rtol=rtol, atol=rtol * abs_mean, equal_nan=True)
        np.testing.assert_allclose(got["norm"], want["norm"], rtol=rtol, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_tensors_of_every_size(dtype):
    gen = torch.Generator().manual_seed(1)
    tensors = [(torch.randn(n, generator=gen) * 3 + 0.5).to(dtype) for n in SIZES]
    tensors.append(torch.randn(64, 33, generator=gen).to(dtype).t())  # non-contiguous
    assert_matches(partial_stats(tensors, count_zeros=True).numpy(), tensors)


@pytest.mark.parametrize("size", [5, FOREACH_NUMEL, 100_000])
def test_non_finite_values_propagate_and_are_counted(size):
    x = torch.randn(size)
    with_nan, with_inf, with_both = x.clone(), x.clone(), x.clone()
    with_nan[[0, 3]] = float("nan")
    with_inf[1] = float("inf")
    with_inf[2] = float("-inf")
    with_both[0], with_both[1] = float("nan"), float("inf")
    tensors = [with_nan, with_inf, with_both]
    rows = partial_stats(tensors, count_zeros=True).numpy()
    assert_matches(rows, tensors)
    stats = finalize(rows)
    assert np.isnan(stats["norm"][0]) and np.isnan(stats["max"][0])
    assert stats["max"][1] == np.inf and stats["min"][1] == -np.inf and np.isnan(stats["mean"][1])
    assert list(stats["nan_count"]) == [2, 0, 1] and list(stats["inf_count"]) == [0, 2, 1]


def test_empty_zero_dim_int_and_bool_tensors():
    tensors = [torch.tensor([]), torch.tensor(2.5), torch.randint(-5, 5, (40,)),
               torch.tensor([True, False, True]), torch.zeros(10), torch.randint(0, 3, (SMALL_NUMEL + 5,))]
    rows = partial_stats(tensors, count_zeros=True).numpy()
    assert_matches(rows, tensors)
    stats = finalize(rows)
    assert stats["numel"][0] == 0 and np.isnan(stats["min"][0]) and stats["norm"][0] == 0  # absent min, zero norm
    assert stats["mean"][1] == 2.5 and stats["norm"][1] == 2.5
    assert stats["zero_frac"][4] == 1.0


def test_rows_keep_input_order_across_small_and_large_paths():
    tensors = [torch.full((SMALL_NUMEL * 2,), 1.0), torch.full((3,), 2.0), torch.tensor([]),
               torch.full((SMALL_NUMEL * 3,), 3.0), torch.full((4,), 4.0)]
    stats = finalize(partial_stats(tensors, count_zeros=True).numpy())
    np.testing.assert_array_equal(stats["max"][[0, 1, 3, 4]], [1.0, 2.0, 3.0, 4.0])


def test_partials_of_shards_merge_to_the_whole():
    whole = torch.randn(10_000)
    whole[17] = float("inf")
    shards = list(whole.split(3000)) + [torch.tensor([])]
    merged = merge(partial_stats(shards, count_zeros=True).numpy())
    np.testing.assert_allclose(merged, reference(whole), rtol=1e-6)


def test_large_values_keep_their_norm_and_float32_overflow_is_not_called_non_finite(path):
    stats = finalize(partial_stats([torch.full((100_000,), 1e15), torch.full((100_000,), 1e30)]).numpy())
    np.testing.assert_allclose(stats["norm"][0], 1e15 * np.sqrt(100_000), rtol=1e-5)
    assert stats["inf_count"][1] == 0 and stats["max"][1] == np.float32(1e30)
    if path == "c_kernel":  # squares in float64
        np.testing.assert_allclose(stats["norm"][1], float(np.float32(1e30)) * np.sqrt(100_000), rtol=1e-6)
    else:  # documented limit of the torch path's float32 accumulation: the sum of squares overflows
        assert stats["norm"][1] == np.inf


def test_the_zero_count_is_only_taken_on_request():
    tensors = [torch.zeros(10), torch.zeros(SMALL_NUMEL + 1)]
    assert np.isnan(finalize(partial_stats(tensors).numpy())["zero_frac"]).all()
    assert (finalize(partial_stats(tensors, count_zeros=True).numpy())["zero_frac"] == 1.0).all()


def test_many_small_tensors_batched_by_size_class_are_exact():
    gen = torch.Generator().manual_seed(2)
    tensors = [torch.randn(n, generator=gen) for n in [5, 6, 7, 7, 100, 120, 127, 128, 1000, 1500, 2000, 2048]]
    tensors[2][1] = float("nan")
    tensors[9][0] = float("-inf")
    assert_matches(partial_stats(tensors, count_zeros=True).numpy(), tensors)


def test_small_tensors_of_mixed_dtypes_in_one_size_class_keep_their_values():
    tensors = [torch.tensor([True, False, True, True]), torch.tensor([-3.5, 2.0, 7.25, 1.0]),
               torch.tensor([1, -200, 3, 4]), torch.tensor([0.5, 0.25, -1.0, 8.0], dtype=torch.bfloat16),
               torch.tensor([9.0, -9.0, 0.0, 1.0])]
    assert_matches(partial_stats(tensors, count_zeros=True).numpy(), tensors)


def test_deferred_blocks_of_mixed_dtypes_pack_together_and_ignore_later_in_place_changes():
    from msprobe_engine.frameworks.torch.backend import concat
    gen = torch.Generator().manual_seed(3)
    shared = torch.randn(300_001, generator=gen)
    tensors = [torch.randn(SMALL_NUMEL + 9, generator=gen, dtype=torch.float64), shared,
               torch.randint(-9, 9, (5000,), generator=gen), torch.randn(8192, generator=gen).to(torch.bfloat16)]
    first = partial_stats(tensors, count_zeros=True, deferred=True)
    second = partial_stats([shared, shared, torch.randn(3, generator=gen)], count_zeros=True, deferred=True)
    expected = [t.clone() for t in tensors + [shared]]
    for t in tensors:
        t.mul_(2)  # after the reductions: the rows keep the values measured
    rows = concat([first, second]).numpy()
    assert_matches(rows[:5], expected)
    np.testing.assert_array_equal(rows[5], rows[4])


@pytest.mark.parametrize("dtype", DTYPES)
def test_mid_size_tensors_on_the_multi_tensor_path_are_exact_and_repeat_their_rows(dtype):
    gen = torch.Generator().manual_seed(2)
    sizes = [SMALL_NUMEL + 1, 5000, 20_000, 33_333, FOREACH_NUMEL]
    tensors = [(torch.randn(n, generator=gen) * 2 - 0.3).to(dtype) for n in sizes]
    tensors[1][7] = float("nan")
    tensors[2][0], tensors[2][-1] = float("inf"), 0.0
    tensors[3][::3] = 0.0
    given = [*tensors, torch.randn(3), tensors[2]]
    rows = partial_stats(given, count_zeros=True).numpy()
    assert_matches(rows, tensors)
    np.testing.assert_array_equal(rows[6], rows[2])
    stats = finalize(rows)
    assert stats["nan_count"][1] == 1 and stats["inf_count"][2] == 1 and stats["zero_frac"][3] >= 1 / 3


def test_tensors_of_one_sign_have_no_zeros_without_counting_them():
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.rand(n, generator=gen) + 0.1 for n in (5000, 6000, 7000, 100_000)]
    tensors += [-t for t in tensors] + [torch.rand(5000, generator=gen) * (torch.arange(5000) % 2)]
    rows = partial_stats(tensors, count_zeros=True).numpy()
    assert_matches(rows, tensors)
    assert (finalize(rows)["zero_frac"][:8] == 0).all() and finalize(rows)["zero_frac"][8] == 0.5


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
@pytest.mark.parametrize("size", [16384, 40_000, FOREACH_NUMEL, 300_001])
def test_zero_counts_are_exact_for_minus_zero_subnormals_and_non_finite_tensors(dtype, size):
    """-0.0 is a zero, a subnormal is not, a nan or an inf is not; one tensor at a time (as a
    hook gives them) and in a multi-tensor group, on every path by length."""
    gen = torch.Generator().manual_seed(size)
    x = torch.randn(size, generator=gen).to(dtype)
    x[::5] = 0.0
    x[1::7] = -0.0
    x[2::11] = torch.finfo(dtype).tiny / 4  # subnormal
    x[3::13] = -torch.finfo(dtype).tiny / 8
    bad = x.clone()
    bad[4] = float("nan")
    bad[6] = float("-inf")
    tensors = [x, bad, x.clone().abs(), -x.abs()]  # two of one sign (+-0 included)
    for rows in ([partial_stats([t], count_zeros=True).numpy()[0] for t in tensors],
                 partial_stats(tensors, count_zeros=True).numpy()):
        assert_matches(np.asarray(rows), tensors)
