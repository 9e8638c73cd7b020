"""``summary_mode: xor``: a 64-bit XOR checksum of a tensor's bytes (the predecessor's).

The bytes (zero-padded to a multiple of 8) are int64 words; the checksum is their XOR. On
the tensor's device they are folded (halves XORed) down to `FOLD_WORDS` words, a copy kept
per tensor; at step end every tensor's words make one host copy and numpy XORs the rest.
Small tensors (at most 64 words, most of an API dump) cost one small copy, larger ones a
few elementwise passes; nothing is read to the host per tensor (``md5``, a CRC-32, copies
every tensor to the host). Written as ``"0x%016x"``; a 0-dim tensor records its value
itself, as the predecessor does.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

FOLD_WORDS = 64


def xor_words(tensor: torch.Tensor) -> torch.Tensor:
    """`FOLD_WORDS` int64 words whose XOR is the checksum of `tensor` (a copy, on its device);
    a 0-dim tensor: a copy of its value."""
    if tensor.dim() == 0:
        return tensor.detach().clone()
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.numel() % 8 or data.storage_offset() % 8:
        data = F.pad(data, (0, -data.numel() % 8))  # a copy: aligned, a multiple of 8 bytes
    words = data.view(torch.int64)
    while words.numel() > FOLD_WORDS:
        if words.numel() % 2:
            words = F.pad(words, (0, 1))
        half = words.numel() // 2
        words = torch.bitwise_xor(words[:half], words[half:])
    return F.pad(words, (0, FOLD_WORDS - words.numel()))  # always a new tensor


def fold(words: np.ndarray) -> list[int]:
    """The checksums of rows of `FOLD_WORDS` words (host)."""
    return np.bitwise_xor.reduce(words, axis=-1).tolist()


def checksum_text(value: int | float | bool) -> int | float | bool | str:
    """The dump.json ``md5`` of a checksum read to the host."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"0x{value & ((1 << 64) - 1):016x}"
    return value
