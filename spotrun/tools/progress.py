"""Progress bars for long transfers (restore, upload, verify, export, gc), on a terminal only.

A thin layer over tqdm: a bar appears on stderr when stderr is a terminal and the work has
taken longer than ``delay_s``; in non-interactive logs (a file, a pipe, a Kubernetes pod's
log) nothing is printed at all. ``SPOTRUN_PROGRESS=0`` turns bars off, ``=1`` forces them on
(for tests of the bar itself).
"""

from __future__ import annotations

import os
import sys
from typing import Any

#: Seconds a transfer must have run before its bar appears.
DEFAULT_DELAY_S = 2.0


def _enabled() -> bool | None:
    """tqdm's ``disable`` argument: ``None`` = on only when stderr is a terminal."""
    setting = os.environ.get("SPOTRUN_PROGRESS", "").strip()
    if setting == "0":
        return True
    if setting == "1":
        return False
    return None


def progress_bar(
    total: float | None, description: str, *, unit: str = "B", delay_s: float | None = None, show: bool = True
) -> Any:
    """A tqdm bar on stderr (a context manager with ``update(n)``; thread-safe updates).

    Args:
        total: the amount of work (bytes for ``unit="B"``, shown in binary units), or ``None``.
        description: a few words before the bar (``"verify step 1200"``).
        unit: ``"B"`` for bytes, else the name of the counted thing (``"file"``).
        delay_s: seconds before the bar appears at all (short work prints nothing); ``None``:
            :data:`DEFAULT_DELAY_S`.
        show: ``False``: no bar whatever the terminal (e.g. on every local rank but 0 of a
            training job, whose ranks share one terminal).
    """
    from tqdm import tqdm

    byte_units = unit == "B"
    return tqdm(
        total=total,
        desc=description,
        unit=unit,
        unit_scale=byte_units,
        unit_divisor=1024 if byte_units else 1000,
        disable=_enabled() if show else True,
        file=sys.stderr,
        delay=DEFAULT_DELAY_S if delay_s is None else delay_s,
        leave=False,
        dynamic_ncols=True,
    )
