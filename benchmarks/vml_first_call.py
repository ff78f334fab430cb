"""The first call of an MKL vector-math function on several threads: how often one thread's
chunk comes out at low accuracy, without and with spotrun's warm-up
(:func:`spotrun.state.numerics.settle_vector_math`; pytorch/pytorch#188792).

Starts waves of fresh processes at once (a machine busier than its cores, as when torchrun
starts every rank together), each computing its first ``sqrt`` of 8192 floats on 2 intra-op
threads and comparing it with a second call. Prints the count of processes whose first call
differed, per arm. Usage: ``python benchmarks/vml_first_call.py [--waves 100] [--per-wave 6]``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = """
import sys, torch
if sys.argv[1] == "settled":
    from spotrun.state.numerics import settle_vector_math
    settle_vector_math()
torch.set_num_threads(2)
x = torch.rand(8192, generator=torch.Generator().manual_seed(0)) * 1e-7
first = x.sqrt()  # split over the 2 threads (ATen's VML grain is 2048 elements)
print(int((first != x.sqrt()).sum()))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waves", type=int, default=100)
    parser.add_argument("--per-wave", type=int, default=6, help="processes started at once per arm")
    args = parser.parse_args()
    arms = ("bare", "settled")
    corrupted = dict.fromkeys(arms, 0)
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
            if int(out.strip() or 0):
                corrupted[arm] += 1
        if (wave + 1) % 10 == 0:
            print(f"after {wave + 1} waves: " + ", ".join(f"{a} {corrupted[a]}/{runs[a]}" for a in arms), flush=True)
    for arm in arms:
        print(f"{arm:8s} first sqrt differed from the second in {corrupted[arm]} of {runs[arm]} fresh processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
