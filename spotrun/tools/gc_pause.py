"""Pausing Python's cyclic garbage collector around bursts of many small objects.

Encoding or decoding the state of a checkpoint creates and drops a few objects per tensor
(records, dicts, tensor views); with tens of thousands of tensors the collector's automatic
passes, each walking every tracked object, took a third of a save and almost half of a
restore (measured: 10,000 tensors, 11 of 31 us per tensor saving, 20 of 44 restoring). None
of this creates reference cycles; reference counting frees it all. The collector runs again
as usual when the block ends.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block, if it was enabled, and enable it after.

    Safe to nest and to use from several threads: a block only re-enables what it disabled
    itself, so a collector the application turned off stays off.
    """
    was_enabled = gc.isenabled()
    if was_enabled:
        gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
