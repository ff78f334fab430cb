"""The RNG policy at another world size: ranks beyond the saved world size get streams of their
own, the same at every such resume (spotrun.state.rng.reseed_new_rank)."""

from __future__ import annotations

import random

import numpy as np
import torch

from spotrun.state.rng import RNGState, reseed_new_rank


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_a_new_rank_reseeds_deterministically_and_differently_from_every_other_rank():
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    saved = RNGState().state_dict()  # what rank r mod N saved

    def resume_as(rank: int) -> tuple:
        RNGState().load_state_dict(saved)
        reseed_new_rank(rank)
        return draws()

    RNGState().load_state_dict(saved)
    restored_only = draws()  # rank r mod N itself draws this
    assert resume_as(2) == resume_as(2)  # the same at every such resume
    assert resume_as(2) != resume_as(3)  # every new rank its own stream
    assert restored_only not in (resume_as(2), resume_as(3))  # none duplicates the saved rank's
