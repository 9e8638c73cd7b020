"""free_benchmark's improve_precision: the predecessor's semantics by default, ours on request.

By default float16/bfloat16 inputs are raised to float32 and float32 is left alone (the
predecessor), so an ordinary float32 convolution passes; ``improve_float32: true`` also raises
float32 to float64 (this project's stricter check), which flags the convolution's float32
rounding (max_rel about 1e-3 here, above float32's threshold of 2e-4).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from msprobe_engine.dump import PrecisionDebugger, load_dump_config
from msprobe_engine.frameworks.torch.capture.free_benchmark import perturb


def _run(tmp_path, **section):
    torch.manual_seed(0)
    conv, x = nn.Conv2d(64, 64, 3), torch.randn(4, 64, 32, 32)
    config = {"task": "free_benchmark", "dump_path": str(tmp_path), "strict": True,
              "free_benchmark": {"list": ["conv2d"], **section}}
    with PrecisionDebugger(config) as debugger:
        debugger.start(conv)
        plain = conv(x)
        debugger.stop()
        debugger.step()
        return debugger._recorder.compared, debugger.task_results, plain


def test_float32_convolution_passes_by_default_and_fails_with_improve_float32(tmp_path):
    compared, failed, _ = _run(tmp_path / "default")
    assert compared == 1 and failed == []
    compared, failed, _ = _run(tmp_path / "ours", improve_float32=True)
    assert compared == 1 and [r.api_name for r in failed] == ["Functional.conv2d.0.forward"]
    assert failed[0].max_rel > 2e-4  # max_rel: the ratio minus one


def test_perturb_raises_float32_only_when_asked():
    x = torch.randn(4)
    (same,), _ = perturb("improve_precision", (x,), {}, 0)
    (raised,), _ = perturb("improve_precision", (x,), {}, 0, float32=True)
    (half,), _ = perturb("improve_precision", (x.half(),), {}, 0)
    assert (same.dtype, raised.dtype, half.dtype) == (torch.float32, torch.float64, torch.float32)
    (noisy,), _ = perturb("add_noise", (x,), {}, 0, float32=True)  # other modes: the flag changes nothing
    assert noisy.dtype == torch.float32


def test_improve_float32_is_a_checked_flag(tmp_path):
    assert load_dump_config({"task": "free_benchmark", "dump_path": str(tmp_path)}).options.improve_float32 is False
    with pytest.raises(Exception, match="improve_float32: expected true or false"):
        load_dump_config({"task": "free_benchmark", "dump_path": str(tmp_path),
                          "free_benchmark": {"improve_float32": 1}})


@pytest.mark.slow
def test_mindspore_improve_precision_follows_the_same_default():
    import mindspore as ms
    import numpy as np

    from msprobe_engine.frameworks.mindspore.capture.free_benchmark import perturb as ms_perturb

    x = ms.Tensor(np.ones(3, np.float32))
    (same,), _ = ms_perturb("improve_precision", (x,), {}, 0)
    (raised,), _ = ms_perturb("improve_precision", (x,), {}, 0, float32=True)
    assert (same.dtype, raised.dtype) == (ms.float32, ms.float64)
