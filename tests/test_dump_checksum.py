"""summary_mode xor: on-device 64-bit XOR checksums, equal to the predecessor's, one host copy per step."""
from __future__ import annotations

import pytest
import torch
from msprobe.pytorch.xor_checksum import xor_checksum as predecessor_xor  # the real predecessor

from msprobe_engine.errors import ConfigError
from msprobe_engine.dump import PrecisionDebugger, load_dump
from msprobe_engine.frameworks.torch.capture.checksum import checksum_text, fold, xor_words


def checksum(tensor: torch.Tensor):
    words = xor_words(tensor)
    return checksum_text(words.item() if words.dim() == 0 else fold(words.cpu().numpy()[None])[0])


@pytest.mark.parametrize("tensor", [
    torch.randn(7), torch.randn(3, 5).t(), torch.randn(33).bfloat16(), torch.arange(9, dtype=torch.int32),
    torch.randn(8, 8)[2:5], torch.randn(10)[1:], torch.tensor(0.5), torch.tensor(3), torch.ones(0),
    torch.rand(5) > 0.5, torch.randn(1000, 7), torch.randn(4097),
])
def test_checksum_equals_the_predecessors(tensor):
    assert checksum(tensor) == checksum_text(predecessor_xor(tensor.contiguous()).item())


def _dump(root, weight_bit_flip=False):
    torch.manual_seed(0)
    model, x = torch.nn.Linear(6, 3), torch.randn(4, 6)
    if weight_bit_flip:
        with torch.no_grad():
            w = model.weight.view(-1).view(torch.int32)
            w[0] ^= 1  # the lowest mantissa bit of one weight
    with PrecisionDebugger({"dump_path": str(root), "summary_mode": "xor", "level": "L1", "strict": True}) as d:
        with d.step_scope(model):
            model(x).relu().sum().backward()
    return d, load_dump(root)[(0, None)].data


def test_xor_dump_detects_one_flipped_bit(tmp_path):
    debugger, first = _dump(tmp_path / "a")
    _, again = _dump(tmp_path / "b")
    _, flipped = _dump(tmp_path / "c", weight_bit_flip=True)
    out = first["Functional.linear.0.forward"]["output"][0]
    assert out["md5"].startswith("0x") and len(out["md5"]) == 18 and "Max" in out
    assert first == again  # bitwise-equal runs: equal checksums
    changed = flipped["Functional.linear.0.forward"]
    assert changed["input_args"][1]["md5"] != first["Functional.linear.0.forward"]["input_args"][1]["md5"]
    assert changed["input_args"][0]["md5"] == first["Functional.linear.0.forward"]["input_args"][0]["md5"]
    assert debugger.transfers == 1


def test_unknown_summary_mode_names_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="summary_mode: 'crc' is not one of statistics, md5, xor"):
        PrecisionDebugger({"dump_path": str(tmp_path), "summary_mode": "crc"})
