"""The worker-side library a training script uses: :class:`.checkpointer.Checkpointer` and its
parts (periodic saves, the emergency save when a notice arrives, the restore), the save decision
at the end of a step, the save meter, and rank 0's events.

Imports torch. May import every room below it: tools, control, storage, notices, state,
checkpoint, data, eventlog.
"""
