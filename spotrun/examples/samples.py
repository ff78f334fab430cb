"""Which samples a step trained on: the dataset indices of the global batch, and their digest.

:class:`IndexedSamples` makes a dataset also return each sample's index, so a rank knows the
indices it actually consumed (not what a formula says it should have). :func:`global_batch`
gathers them over the data-parallel ranks, and :func:`samples_digest` reduces them to the
short hex digest the example trainer logs as ``samples``: the same digest in two runs means
the same global batch, whatever the world size or layout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

try:  # the library's own definition, once spotrun.data.loader has it
    from spotrun.data.loader import samples_digest
except ImportError:  # pragma: no cover - same formula, until spotrun.data.loader provides it

    def samples_digest(indices: Iterable[int]) -> str:
        """First 16 hex characters of SHA-256 over the sorted indices, comma-joined decimal
        (``[3, 1, 2]`` -> sha256(b"1,2,3")[:16])."""
        text = ",".join(str(i) for i in sorted(int(i) for i in indices))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class IndexedSamples(Dataset):
    """``dataset[i] + (i,)``: each sample (a tuple) with its index appended, so a batch's
    last element is the (B,) int64 tensor of the samples' dataset indices."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple:
        return (*self.dataset[index], index)


def global_batch(local_indices: torch.Tensor, group: Any = None) -> list[int]:
    """The dataset indices of the whole global batch: ``local_indices`` ((B,) int64, this
    rank's batch) gathered over the data-parallel ``group`` (``None``: all ranks; no process
    group: this rank's alone). Every rank of the group must call it with the same B."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local_indices.tolist()
    gathered = [torch.empty_like(local_indices) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local_indices, group=group)
    return torch.cat(gathered).tolist()
