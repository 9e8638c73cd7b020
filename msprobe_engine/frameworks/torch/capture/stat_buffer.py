"""The step's tensor statistics, batched on the device, with one host transfer per step.

`row(t)` gives a tensor its row in the step's packed statistics. Tensors wait in a batch and
are reduced together by the backend's ``partial_stats`` (one call costs about as much as a
few tensors, so batching is most of the speed) when the batch is large, at the end of a
backward pass and at step end. Before a call writes into a tensor, `protect` replaces the
waiting tensors that share its storage by copies (the waiting tensors' storages are looked up
there, only while something waits and a call writes), so their statistics are those of the
values they had when recorded. A tensor seen again unchanged (same object, same version)
keeps its row. `to_host()` packs the rows and makes the step's single device-to-host copy.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Iterable

import numpy as np
import torch

from msprobe_engine.frameworks.torch.tensor_identity import KnownTensors, version
from msprobe_engine.stats import empty_rows

log = logging.getLogger("msprobe_engine")

#: a batch is reduced once it holds this many bytes or tensors
BATCH_BYTES = 64 << 20
BATCH_TENSORS = 1024


def _storage(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less tensors
        return None


class StatBuffer:
    """Rows of one step. Not thread-safe: the recorder serialises calls."""

    def __init__(self, backend: Any, deferred: bool = False) -> None:
        """`deferred`: batches are reduced but packed only at `to_host` (cheaper when many small
        batches are flushed: L0 measures at every module hook)."""
        self.backend = backend
        self.deferred = deferred
        self.transfers = 0
        self.reset()

    def reset(self) -> None:
        """Forget the step (rows, batch and the seen-tensor cache)."""
        self._blocks: list[Any] = []
        self._rows = 0
        self._batch: list[torch.Tensor] = []
        self._versions: list[int] = []
        #: storage -> positions in the batch, for `protect`; built there, up to `_indexed`
        self._owners: dict[int, list[int]] = {}
        self._indexed = 0
        self._bytes = 0
        self._seen = KnownTensors()
        self._copies = KnownTensors()

    @property
    def pending(self) -> bool:
        return bool(self._batch)

    def row(self, tensor: torch.Tensor) -> int:
        """The row of `tensor`'s statistics (reduced later, in a batch)."""
        now = version(tensor)
        index = self._seen.get(tensor, now)
        if index is not None:
            return index
        index = self._rows + len(self._batch)
        self._seen.put(tensor, now, index)
        self._batch.append(tensor)
        self._versions.append(now)
        self._bytes += tensor.nbytes
        if self._bytes >= BATCH_BYTES or len(self._batch) >= BATCH_TENSORS:
            self.flush()
        return index

    def protect(self, written: Iterable[torch.Tensor]) -> None:
        """A call is about to write into `written`: keep copies of waiting tensors sharing their
        storage, and measure `written` anew when seen again (collectives leave the version as it was)."""
        self._index()
        for tensor in written:
            self._seen.forget(tensor)
            self._copies.forget(tensor)
            for pos in self._owners.pop(_storage(tensor), ()):
                copy = self._batch[pos].detach().clone()
                self._batch[pos], self._versions[pos] = copy, version(copy)

    def _index(self) -> None:
        """Add the batch's tensors recorded since the last call to the storage index."""
        batch, owners = self._batch, self._owners
        for pos in range(self._indexed, len(batch)):
            storage = _storage(batch[pos])
            if storage is not None:
                owners.setdefault(storage, []).append(pos)
        self._indexed = len(batch)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of `tensor` as it is now (shared while the same version is still alive)."""
        now = version(tensor)
        ref = self._copies.get(tensor, now)
        if ref is not None and (alive := ref()) is not None:
            return alive
        snapshot = tensor.detach().to("cpu", copy=True)
        self._copies.put(tensor, now, weakref.ref(snapshot))
        return snapshot

    def flush(self) -> None:
        """Reduce the waiting batch on its device (no host transfer)."""
        if not self._batch:
            return
        batch, versions = self._batch, self._versions
        self._batch, self._versions, self._owners, self._indexed, self._bytes = [], [], {}, 0, 0
        changed = sum(version(t) != v for t, v in zip(batch, versions))
        if changed:
            log.warning("msprobe dump: %d tensor(s) changed in place (outside the calls the dump sees) before "
                        "their statistics were taken; their records show the changed values", changed)
        self._blocks.append(self.backend.partial_stats(batch, deferred=self.deferred))
        self._rows += len(batch)

    def to_host(self) -> np.ndarray:
        """Every row of the step as one float64 array: the step's one device-to-host copy."""
        self.flush()
        if not self._blocks:
            return empty_rows()
        host = self.backend.to_host(self.backend.concat(self._blocks))
        self.transfers += 1
        return host
