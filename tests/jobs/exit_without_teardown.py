"""How the gloo jobs here end: without interpreter finalization.

Freeing gloo's threads while the interpreter is torn down aborts a rank now and then after
its result is written ("terminate called without an active exception", SIGABRT;
pytorch/pytorch#179291), as spotrun's example trainer notes; seen in loaded CI runs. The
scripts import this from their own directory (sys.path[0] when torchrun runs them).
"""

import os
import sys
from typing import NoReturn


def exit_without_teardown(code: int = 0) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
