"""The settings of one rank that decide the order of floating-point operations.

Floating-point addition is not associative, so a run is bit-identical to another only when
both split and order their sums the same way. That is decided by the settings recorded
here; the machine's load is not among them (docs/guide/exact-resume.md says
what was measured).

Saved with every checkpoint as part of each rank's own state (JSON values only). On
restore a rank compares the saved settings with its own and logs a warning naming each
difference: the job goes on, but it can no longer be bit-identical to an uninterrupted run.
``spotrun drill`` reads the same values to name the cause when its comparison fails.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

#: Name of this state in each rank's checkpointed state (reserved in ``rank_state``).
NUMERICS_STATE_NAME = "numerics"

#: key -> how a difference in it is explained (what to set to make them equal).
_WHAT_TO_SET = {
    "intra_op_threads": "set the same thread count for every run (OMP_NUM_THREADS, or torch.set_num_threads)",
    "torch_version": "install the same torch",
    "cpu_capability": "run on the same CPU type (torch.backends.cpu.get_cpu_capability())",
    "cuda_devices": "run on the same GPU models",
    "deterministic_algorithms": "call torch.use_deterministic_algorithms the same way",
}


#: The float unary ops torch computes with MKL's vector math (VML) on x86 (``ATen/cpu/vml.h``,
#: ``IMPLEMENT_VML_MKL``); a test checks the list against the installed torch's header.
VML_OPS = (
    "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp",
    "log", "log10", "log2", "sin", "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip


def settle_vector_math() -> None:
    """Call each of :data:`VML_OPS` once on one element, float and double, on this thread alone.

    MKL picks each VML function's kernel at its first call. When that first call runs on several
    intra-op threads at once (a fresh process's first large ``sqrt``: a resumed run's first
    optimizer step, under load), one thread can compute its whole chunk with a low-accuracy
    kernel (pytorch/pytorch#188792; measured here by ``benchmarks/vml_first_call.py``). A resumed
    run then differs from an uninterrupted one although both computed the same thing. A call on
    one element runs on the calling thread only and settles the choice first.
    """
    if not torch.backends.mkl.is_available():
        return
    for dtype in (torch.float32, torch.float64):
        one = torch.full((1,), 0.5, dtype=dtype)
        for op in VML_OPS:
            getattr(torch, op)(one)


def current_numerics() -> dict[str, Any]:
    """This process's settings, as JSON values.

    Keys: ``intra_op_threads`` (int, ``torch.get_num_threads()``), ``torch_version`` (str),
    ``cpu_capability`` (str, e.g. ``"AVX512"``: the vector kernels torch dispatches to),
    ``cuda_devices`` (list of device names; empty unless CUDA is initialised),
    ``deterministic_algorithms`` (bool).
    """
    devices: list[str] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "intra_op_threads": torch.get_num_threads(),
        "torch_version": str(torch.__version__),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "cuda_devices": devices,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def describe_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One sentence per setting that differs, e.g. ``"intra_op_threads: 2 in the
    checkpoint, 1 here - set the same thread count ..."``; empty when all agree.

    Keys present on one side only are ignored (written by another spotrun version).
    """
    return [
        f"{key}: {saved[key]!r} in the checkpoint, {current[key]!r} here - {_WHAT_TO_SET.get(key, 'make them equal')}"
        for key in sorted(set(saved) & set(current))
        if saved[key] != current[key]
    ]


class NumericsState:
    """A ``Stateful`` for :func:`current_numerics`: saves it; on load, warns about differences.

    Loading never changes a setting (the job chose its threads before it restored).
    After a load, :attr:`differences` lists what differed (see :func:`describe_differences`).
    """

    def __init__(self) -> None:
        self.differences: list[str] = []

    def state_dict(self) -> dict[str, Any]:
        return current_numerics()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            log.warning("ignoring the checkpoint's numerics settings: not a dict (%s)", type(state).__name__)
            return
        self.differences = describe_differences(state, current_numerics())
        if self.differences:
            log.warning(
                "this process computes differently from the one that wrote the checkpoint: %s. Training "
                "goes on, but from here it is not bit-identical to an uninterrupted run",
                "; ".join(self.differences),
            )
