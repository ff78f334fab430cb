"""The first call of an MKL vector-math function on several threads: how often one thread's
chunk comes out at low accuracy, without and with spotrun's warm-up
(:func:`spotrun.state.numerics.settle_vector_math`; pytorch/pytorch#188792).

Starts waves of fresh processes at once (a machine busier than its cores, as when torchrun
starts every rank together), each calling every VML op once on 8192 floats and once on 8192
doubles, on 2 intra-op threads, and comparing each first call with a second one. Prints, per
arm, the processes with a first call that differed and the count of such calls.
Usage: ``python benchmarks/vml_first_call.py [--waves 200] [--per-wave 1]``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from spotrun.state.numerics import VML_OPS

CHILD = """
import sys, torch
from spotrun.state.numerics import VML_OPS, settle_vector_math
if sys.argv[1] == "settled":
    settle_vector_math()
torch.set_num_threads(2)
corrupted = 0
for dtype in (torch.float32, torch.float64):
    # inside every op's domain (acos, erfinv, log...); 8192 elements: split over the 2 threads
    x = torch.rand(8192, generator=torch.Generator().manual_seed(0), dtype=dtype) * 0.5 + 0.25
    for op in VML_OPS:
        f = getattr(torch, op)
        first = f(x)  # this op's first call in this process (unless settled)
        corrupted += int(not torch.equal(first, f(x)))
print(corrupted)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waves", type=int, default=200)
    parser.add_argument("--per-wave", type=int, default=1, help="processes started at once per arm")
    args = parser.parse_args()
    arms = ("bare", "settled")
    corrupted = dict.fromkeys(arms, 0)  # processes with a first call that differed
    calls = dict.fromkeys(arms, 0)  # first calls that differed
    runs = dict.fromkeys(arms, 0)
    for wave in range(args.waves):
        started = [
            (arm, subprocess.Popen([sys.executable, "-c", CHILD, arm], stdout=subprocess.PIPE, text=True))
            for _ in range(args.per_wave)
            for arm in arms  # interleaved: both arms see the same load
        ]
        for arm, child in started:
            out, _ = child.communicate(timeout=300)
            runs[arm] += 1
            differed = int(out.strip() or 0)
            calls[arm] += differed
            corrupted[arm] += differed > 0
        if (wave + 1) % 10 == 0:
            figures = ", ".join(f"{a} {corrupted[a]}/{runs[a]} ({calls[a]} calls)" for a in arms)
            print(f"after {wave + 1} waves: {figures}", flush=True)
    for arm in arms:
        print(
            f"{arm:8s} a first call differed from the second in {corrupted[arm]} of {runs[arm]} fresh processes "
            f"({calls[arm]} of {runs[arm] * 2 * len(VML_OPS)} first calls)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
