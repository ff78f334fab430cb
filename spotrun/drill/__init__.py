"""``spotrun drill``: rehearse a preemption on the user's own job, restart it, check that the
restart went on exactly from the emergency checkpoint, report. :mod:`.phases` runs the three
phases (notice, restart, reference run), :mod:`.child` their ``spotrun run`` processes,
:mod:`.clouds` one fake notice per cloud, :mod:`.compare` and :mod:`.cause` the comparison.
The command line is :mod:`spotrun.cli.drill`.

May import tools, control, storage, notices, checkpoint, state and supervisor.
"""
