"""Restore the newest loadable step of a local root ROOT into a fresh ``Linear(4, 4)`` and a plain
dict, as tests/unit/checkpoint/test_bounded_parsing.py saved them, and print what was restored as one JSON line
(``step``, the weight's and bias's bytes in hex, ``epoch``). The test runs it under an
address-space limit: a damaged checkpoint must not make a restore grow."""

from __future__ import annotations

import json
import logging
import sys

import torch

import spotrun
from spotrun.storage import LocalStorage

logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
model = torch.nn.Linear(4, 4)
extra: dict = {"epoch": 0}
ckpt = spotrun.Checkpointer(
    {"model": model, "extra": extra}, storage=LocalStorage(sys.argv[1], fsync=False), handle_signals=False
)
step = ckpt.restore()
print(
    json.dumps(
        {
            "step": step,
            "weight": model.weight.detach().numpy().tobytes().hex(),
            "bias": model.bias.detach().numpy().tobytes().hex(),
            "epoch": extra.get("epoch"),
        }
    )
)
