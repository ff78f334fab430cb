"""Why a drill's resumed run is not bit-identical to its reference run: the likeliest cause,
read from the differences alone (:mod:`spotrun.drill.compare`).

In order: the two runs ran on different numbers of ranks (an elastic node range); they
computed with different settings (each rank's ``numerics`` state,
:mod:`spotrun.state.numerics`: thread count, torch, CPU type, GPUs); only RNG states differ
after a fresh start (the job does not seed); only floating-point values differ, by
rounding-sized amounts, while everything else (data position, RNG states, counters) is
identical (the arithmetic is not deterministic on this machine); else state that is not
saved or restored.
"""

from __future__ import annotations

from spotrun.drill.compare import Difference
from spotrun.state.numerics import NUMERICS_STATE_NAME

#: Largest difference, relative to a value's scale, still taken for rounding: float32 rounds
#: at about 6e-8 relative, and a few dozen steps of training grow such differences by a few
#: orders of magnitude; a state that is not restored differs by far more.
ROUNDING_RELATIVE_DIFF = 1e-4

#: The page that explains when a resume is bit-exact.
_EXACT_RESUME_PAGE = "docs/guide/exact-resume.md"


def likely_cause(differences: list[Difference], start_step: int | None) -> str:
    """One sentence naming the likeliest cause of ``differences`` (non-empty) and what to do.

    ``start_step``: the step both runs started from; ``None`` when both started fresh.
    """
    world = [d for d in differences if d.key == "world_size"]
    if world:
        return (
            f"the two runs ran on different numbers of ranks ({world[0].what}, the resumed run's first; an "
            "elastic torchrun --nnodes MIN:MAX gets as many nodes as join its rendezvous): a bit-for-bit "
            "comparison needs the same world size; drill with a fixed --nnodes, or with all MAX nodes up"
        )
    settings = [d for d in differences if _is_numerics(d.key)]
    if settings:
        named = "; ".join(f"{d.key.replace(f'/{NUMERICS_STATE_NAME}/', ' ')}: {d.what}" for d in settings)
        return (
            f"the two runs computed with different settings ({named}; the resumed run's value first): "
            "a resume is bit-exact only with the same thread count, torch, CPU type and GPUs "
            f"(see {_EXACT_RESUME_PAGE})"
        )
    only_rngs = all(d.key.startswith("rank ") and "/rng/" in d.key for d in differences)
    if only_rngs and start_step is None:
        return (
            "only RNG states differ and both runs started fresh: the job likely does not seed every "
            "generator at start (Python random, NumPy, torch); seed them, or drill from an existing checkpoint"
        )
    if all(_rounding_sized(d) for d in differences):
        largest = max(d.max_relative_diff or 0.0 for d in differences)
        return (
            f"only floating-point values differ, by at most {largest:.2g} of their scale, and everything "
            "else (data position, RNG states, step counters) is identical: both runs did the same steps "
            "but rounded differently although they recorded the same settings: some kernel's result "
            "depends on timing (on GPUs: torch.use_deterministic_algorithms(True) and "
            f"CUBLAS_WORKSPACE_CONFIG=:4096:8; see {_EXACT_RESUME_PAGE})"
        )
    return "the job has state spotrun does not save and restore, or is not deterministic"


def _is_numerics(key: str) -> bool:
    return key.startswith("rank ") and f"/{NUMERICS_STATE_NAME}/" in key


def _rounding_sized(d: Difference) -> bool:
    return d.max_relative_diff is not None and d.max_relative_diff <= ROUNDING_RELATIVE_DIFF
