"""spotrun: keep torchrun training alive on preemptible machines.

Library entry points used inside a training script:

* :class:`Checkpointer` - sharded, checksummed, pickle-free checkpoints; exact resume.
* :class:`ResumableDataLoader`, :class:`ResumableDistributedSampler` - data order that
  resumes at the exact next batch.
* :func:`preemption_notice`, :func:`on_preemption_notice` - the notice for scripts that save
  by their own means (no torch import: cheap to call every step).
"""

from spotrun._version import __version__ as __version__
from spotrun.control.preemption import PreemptionNotice, on_preemption_notice, preemption_notice  # noqa: E402
from spotrun.errors import (  # noqa: E402
    CheckpointError,
    CheckpointSaveError,
    CollectiveTimeoutError,
    CommitUnsupportedError,
    ConfigError,
    CorruptShardError,
    FencedError,
    ManifestError,
    NoCheckpointError,
    SpotrunError,
    StateMismatchError,
    StateSerializationError,
    StorageError,
)

__all__ = [
    "Checkpointer",
    "ResumableDataLoader",
    "ResumableDistributedSampler",
    "PreemptionNotice",
    "on_preemption_notice",
    "preemption_notice",
    "CheckpointError",
    "CheckpointSaveError",
    "CollectiveTimeoutError",
    "CommitUnsupportedError",
    "ConfigError",
    "CorruptShardError",
    "FencedError",
    "ManifestError",
    "NoCheckpointError",
    "SpotrunError",
    "StateMismatchError",
    "StateSerializationError",
    "StorageError",
]


def __getattr__(name: str):
    # The torch-dependent parts load on first use, so that `spotrun run` (the supervisor)
    # starts in milliseconds and handles a SIGTERM that arrives right after it starts.
    if name == "Checkpointer":
        from spotrun.train.checkpointer import Checkpointer

        return Checkpointer
    if name in ("ResumableDataLoader", "ResumableDistributedSampler"):
        from spotrun.data import loader as data

        return getattr(data, name)
    raise AttributeError(f"module 'spotrun' has no attribute {name!r}")
