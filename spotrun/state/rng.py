"""Capture and restore every random number generator of one rank.

Covers Python's ``random``, NumPy's legacy global generator, torch's CPU generator and
the generator of every CUDA device (when CUDA is initialised). The captured value is
a plain nested dict of ints, floats, lists and tensors, so it goes through
:mod:`spotrun.checkpoint.tree` like any other state (no pickle).

Shapes and dtypes of the captured tensors:
    ``torch_cpu``: uint8, shape (5056,) (whatever ``torch.get_rng_state()`` returns)
    ``cuda``: list of uint8 tensors, one per visible device
    ``numpy/keys``: int64, shape (624,) (the MT19937 key, widened from uint32)
    ``python/internal``: int64, shape (625,) (``random.getstate()[1]``)
"""

from __future__ import annotations

import hashlib
import logging
import random
from typing import Any

import numpy as np
import torch

from spotrun.errors import CorruptStateError

log = logging.getLogger(__name__)


class RNGState:
    """A ``Stateful`` for all generators of this process (``state_dict`` / ``load_state_dict``)."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss_next = random.getstate()
        kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
        state: dict[str, Any] = {
            "python": {
                "version": version,
                "internal": torch.tensor(internal, dtype=torch.int64),
                "gauss_next": gauss_next,
            },
            "numpy": {
                "kind": kind,
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gaussian),
            },
            "torch_cpu": torch.get_rng_state(),
            "cuda": [],
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore every generator.

        Raises:
            CorruptStateError: the saved state lacks a generator, or a generator rejects it (a
                state spotrun wrote holds every one, in the form each accepts: the checkpoint is
                damaged, not the job's code).
        """
        try:
            py = state["python"]
            random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss_next"]))
            npst = state["numpy"]
            keys = npst["keys"].numpy().astype(np.uint32)
            np.random.set_state((npst["kind"], keys, npst["pos"], npst["has_gauss"], npst["cached_gaussian"]))
            torch.set_rng_state(state["torch_cpu"])
            cuda_states = state["cuda"]
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError, OverflowError) as exc:
            raise CorruptStateError(f"saved RNG state is malformed: {exc!r}") from exc
        if cuda_states and torch.cuda.is_available():
            count = torch.cuda.device_count()
            if count != len(cuda_states):
                log.warning(
                    "checkpoint holds RNG states of %d CUDA devices, this process sees %d; restoring the first %d",
                    len(cuda_states),
                    count,
                    min(count, len(cuda_states)),
                )
            for index, device_state in enumerate(cuda_states[:count]):
                torch.cuda.set_rng_state(device_state, device=index)
        elif cuda_states:
            log.warning("checkpoint holds CUDA RNG states but CUDA is not available; skipped")


def reseed_new_rank(rank: int) -> int:
    """Give a rank that has no saved RNG state of its own (the job grew) streams of its own.

    Policy (a resume at another world size): rank ``r`` restores the generators saved by
    rank ``r mod N`` (N: the saved world size); a rank ``r >= N``, whose restored state
    duplicates rank ``r mod N``'s, then reseeds every generator (Python, NumPy, torch CPU and
    each CUDA device) from the SHA-256 of that restored torch CPU state and ``r``: the same
    seed at every such resume, and a different stream on every rank.

    Returns:
        The seed used (64 bits).
    """
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes() + f"rank {rank}".encode()).digest()
    seed = int.from_bytes(digest[:8], "little")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also every CUDA device
    return seed
