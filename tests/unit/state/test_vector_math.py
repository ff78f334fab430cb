"""The warm-up of MKL's vector math before training computes (pytorch/pytorch#188792): a first
call on several threads can give one thread's chunk a low-accuracy kernel, so that a resumed run
differs from an uninterrupted one. The race itself is too rare to trigger in a unit test:
``benchmarks/vml_first_call.py`` measures it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from spotrun.state.numerics import VML_OPS


def vml_header_ops() -> set[str]:
    header = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "cpu", "vml.h")
    with open(header, encoding="utf-8") as f:
        text = f.read()
    # the ops compiled in: lines that start with the macro (commented-out ones start with //)
    return set(re.findall(r"^IMPLEMENT_VML_MKL\((\w+),", text, flags=re.MULTILINE))


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch has no MKL: no VML race")
def test_the_warm_up_covers_every_vml_op_of_the_installed_torch():
    ops = vml_header_ops()
    assert "sqrt" in ops, "torch's vml.h no longer lists its MKL ops as this test reads them"
    assert ops <= set(VML_OPS), f"ops torch computes with MKL VML that the warm-up misses: {sorted(ops - set(VML_OPS))}"


def test_a_checkpointer_settles_the_vector_math_before_a_restore(tmp_path):
    """In a fresh process, constructing a Checkpointer calls every VML op once (counted through
    torch's dispatcher, so that this test sees what a training script's process does)."""
    script = f"""
import torch, spotrun
from spotrun.state.numerics import VML_OPS
seen = []
class Count(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        seen.append(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {{}}))
with Count():
    spotrun.Checkpointer({{"w": {{"x": torch.zeros(2)}}}}, uri={str(tmp_path / "ck")!r}, handle_signals=False)
missing = [op for op in VML_OPS if op not in seen] if torch.backends.mkl.is_available() else []
print("missing", missing)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "missing []" in done.stdout
