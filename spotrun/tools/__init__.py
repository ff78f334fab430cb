"""Small shared tools: process-group helpers, the GC pause, logging set-up, progress bars, and
what stays in a process when it forks (:mod:`.process_local`).

The bottom room: imports no other room (only :mod:`spotrun.errors`). Only :mod:`.dist`
imports torch, on use.
"""
