"""The contract between the supervisor and its training workers, torch-free: the environment
variables ``spotrun run`` sets (:mod:`.env`), the files of the control directory
(:mod:`.files`: notices, save figures, fence reports), the saves' figures both sides read
(:mod:`.saves`), the notice listeners, and the notice for scripts that save by their own means
(:mod:`.preemption`).

Imports only :mod:`spotrun.tools` and :mod:`spotrun.errors`; never torch, so the supervisor
starts in milliseconds.
"""
