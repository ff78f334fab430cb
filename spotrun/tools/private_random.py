"""Client libraries that draw from Python's global random generator get a generator of their own.

The training process's global ``random`` state is part of what a checkpoint captures and a resume
restores. A storage client that draws from it on a save's thread (google-cloud-storage picks each
multipart upload's boundary with ``random.randrange``; azure-core, google-auth and botocore jitter
token and credential refreshes with it) moves the training's generator at moments no resume
repeats: the resumed run then differs from the uninterrupted one. Each such module's ``random``
name is pointed at a private ``random.Random`` (same functions, its own state), so the global
generator stays the training's alone. ``tests/unit/checkpoint/test_saves_leave_the_rngs_alone.py``
fails when a library starts drawing from it again.
"""

from __future__ import annotations

import importlib
import random
import threading

_PRIVATE = random.Random()  # seeded from os.urandom; draws are never part of any result
_lock = threading.Lock()


def isolate(*module_names: str) -> None:
    """Give each named module (where it can be imported and uses the global ``random``) the private
    generator; a module that is missing (another version of its library) is skipped."""
    with _lock:
        for name in module_names:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            if getattr(module, "random", None) is random:
                module.random = _PRIVATE
