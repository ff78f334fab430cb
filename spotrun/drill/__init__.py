"""``spotrun drill``: rehearse a preemption on the user's own job, restart it, check that the
restart went on exactly from the emergency checkpoint, report.

    spotrun drill --cloud aws --after-steps 200 -- torchrun --nproc-per-node 8 train.py

- :mod:`~spotrun.drill.phases`: :func:`~spotrun.drill.phases.run_drill`, the three phases
  (notice, restart, reference run); :mod:`~spotrun.drill.child` starts and stops their
  ``spotrun run`` processes.
- :mod:`~spotrun.drill.config`, :mod:`~spotrun.drill.report`: its options and its report.
- :mod:`~spotrun.drill.clouds`: one module per notice the drill can serve (aws, gcp, azure:
  a fake metadata server each; signal: a SIGTERM), registered in
  :data:`spotrun.drill.clouds.MODULES`.
- :mod:`~spotrun.drill.scratch`, :mod:`~spotrun.drill.compare`, :mod:`~spotrun.drill.cause`:
  the reference run's root, the bit-for-bit comparison, the likeliest cause of a difference.

The command line is :mod:`spotrun.commands.drill`.
"""
