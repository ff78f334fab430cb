"""The event log kept with the checkpoints (:mod:`.records`), the goodput accounting ``spotrun
report`` prints from it (:mod:`.goodput`) and the checkpoint-interval advice (:mod:`.advice`).

Torch-free. May import tools, control, storage and checkpoint (its torch-free modules).
"""
