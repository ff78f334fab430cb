"""The scale model behind ``benchmarks/scale_plan.py``: a simulated job's save and restore, planned
by spotrun's own code on meta tensors (``state``, ``save_side``, ``restore_side``), the requests
they make (``store``: the one place that asks the backend), DCP's layout of the same state
(``dcp_side``), the figures (``model``, ``report``) and their bounds (``bounds``).
Details: ``docs/design/scale.md``."""
