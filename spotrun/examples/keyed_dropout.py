"""Dropout whose masks depend on the sample, not on the rank that happens to process it.

Ordinary dropout draws its masks from each rank's torch generator, in the order the rank
processes its batch: the mask a sample gets depends on the world size, the rank and the
sample's position in the per-rank batch. With *sample-keyed* dropout the keep-mask of one
sample at one dropout site is drawn from a private generator seeded with a hash of
``(seed, sample index, site, step)``; the same sample at the same step gets the same mask on any
layout (1 rank or 8, data or tensor parallel), so a run with dropout on computes the same
function at any world size (the losses then differ only by the reduction order).

Sites: 0 is the embedding dropout; transformer block ``l`` has 1 + 3l (attention weights),
2 + 3l (attention output) and 3 + 3l (MLP output). A mask is drawn for the whole
per-sample shape (all heads, full width) and a tensor-parallel rank keeps its slice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def mask_seed(seed: int, sample_index: int, site: int, step: int) -> int:
    """The generator seed of one sample's mask at one site and step: the first 63 bits of
    BLAKE2b over the four decimal numbers (non-negative, below 2**63)."""
    digest = hashlib.blake2b(f"{seed},{sample_index},{site},{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclass(frozen=True)
class SampleKeys:
    """What the dropout masks of one step's local batch are keyed by.

    Attributes:
        seed: the run's seed (``--seed``).
        step: the optimizer step being computed (1-based).
        sample_indices: the dataset index of each of the B samples of the local batch, in
            batch order.
    """

    seed: int
    step: int
    sample_indices: Sequence[int]

    def keep_mask(self, site: int, shape: tuple[int, ...], p: float, device: torch.device) -> torch.Tensor:
        """(B, *shape) bool: True where an element is kept (probability ``1 - p``).

        Each sample's (``shape``) slice comes from a CPU generator seeded with
        :func:`mask_seed`, so it is the same on every device and layout.
        """
        masks = []
        for index in self.sample_indices:
            generator = torch.Generator()
            generator.manual_seed(mask_seed(self.seed, int(index), site, self.step))
            masks.append(torch.rand(shape, generator=generator) >= p)
        return torch.stack(masks).to(device)  # (B, *shape)


class SiteDropout(nn.Module):
    """Dropout with probability ``p`` at dropout site ``site``.

    ``forward(x, keys)``: x (B, ...) float. With ``keys=None`` it is ``nn.Dropout`` (the
    global torch generator); with :class:`SampleKeys` the mask of sample b comes from
    ``keys.sample_indices[b]``. Kept elements are scaled by ``1 / (1 - p)`` either way;
    identity in eval mode or with ``p == 0``.
    """

    def __init__(self, p: float, site: int) -> None:
        super().__init__()
        self.p = p
        self.site = site

    def forward(self, x: torch.Tensor, keys: SampleKeys | None = None) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if keys is None:
            return F.dropout(x, self.p, training=True)
        keep = keys.keep_mask(self.site, tuple(x.shape[1:]), self.p, x.device)  # (B, ...)
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}"
