"""A save (synchronous or in the background) and a restore leave the training process's global
random generators as they found them, on every backend.

The global generators are part of the state a checkpoint captures and a resume restores: a draw
from them on a save's thread would move the training's generator at a moment no resume repeats
(found by `spotrun drill` on gs://: google-cloud-storage drew each upload's multipart boundary
from Python's ``random``; spotrun.tools.private_random gives such libraries their own).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import spotrun

ROOTS = {"s3": "s3_bucket", "gcs": "gcs_bucket", "azure": "azure_container"}


@pytest.fixture(params=["local", *ROOTS])
def root_uri(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "ck")
    return f"{request.getfixturevalue(ROOTS[request.param]).uri}/job"


def global_rng_states() -> tuple:
    numpy_state = np.random.get_state()
    return (random.getstate(), numpy_state[0], numpy_state[1].tolist(), numpy_state[2:], torch.get_rng_state().tolist())


@pytest.mark.parametrize("background_saves", [False, True], ids=["synchronous", "background"])
def test_saves_and_restores_leave_the_global_random_generators_alone(root_uri, background_saves):
    state = {"model": {"w": torch.arange(1 << 18, dtype=torch.float32), "b": torch.zeros(3)}}
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    before = global_rng_states()
    ckpt = spotrun.Checkpointer(state, uri=root_uri, handle_signals=False, background_saves=background_saves)
    for step in (1, 2, 3):
        ckpt.save(step)
    ckpt.wait_for_save()
    ckpt.close()
    assert global_rng_states() == before, "a save drew from a global random generator"
    fresh = {"model": {"w": torch.zeros(1 << 18), "b": torch.ones(3)}}
    reader = spotrun.Checkpointer(fresh, uri=root_uri, handle_signals=False)
    # a restore sets the generators to the saved states: the ones above, untouched since
    assert reader.restore() == 3
    reader.close()
    assert global_rng_states() == before, "a restore drew from a global random generator after setting it"
    assert torch.equal(fresh["model"]["w"], state["model"]["w"])
