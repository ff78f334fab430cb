"""``spotrun drill``: rehearse a preemption on the user's own job, restart it, check that the
restart went on exactly from the emergency checkpoint, report.

:mod:`~spotrun.drill.phases` runs the three phases (notice, restart, reference run); the other
modules hold its options, report, fake clouds and comparison. The command line is
:mod:`spotrun.commands.drill`; the modules: ``docs/design/internals.md`` (Drill).
"""
