"""``summary_mode: xor``: a 64-bit XOR checksum of a tensor's bytes, computed on its device.

The bytes (zero-padded to a multiple of 8) are read as int64 words and folded with XOR in
log2(n) halving steps: a few elementwise passes on the device, no host copy (``md5``, a
CRC-32, copies every tensor to the host). Equal checksums are the predecessor's bitwise-
equality check between runs; one flipped bit changes it. Written as ``"0x%016x"``; a
0-dim tensor's value itself, as the predecessor does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def xor_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """The 0-dim int64 checksum of `tensor` (0-dim tensors: a copy of the value), on its device."""
    if tensor.dim() == 0:
        return tensor.detach().clone()
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=tensor.device)
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.numel() % 8:
        data = F.pad(data, (0, 8 - data.numel() % 8))
    words = data.view(torch.int64) if data.storage_offset() % 8 == 0 else data.clone().view(torch.int64)
    while words.numel() > 1:
        if words.numel() % 2:
            words = F.pad(words, (0, 1))
        half = words.numel() // 2
        words = torch.bitwise_xor(words[:half], words[half:])
    return words[0]


def checksum_text(value: int | float | bool) -> int | float | bool | str:
    """The dump.json ``md5`` of a checksum read to the host."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"0x{value & ((1 << 64) - 1):016x}"
    return value
