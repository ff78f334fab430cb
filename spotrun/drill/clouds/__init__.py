"""The clouds whose notice ``spotrun drill`` rehearses, one module each.

Each module of :data:`MODULES` defines ``CLOUD``, a :class:`~spotrun.drill.clouds.base.DrillCloud`
subclass that knows its fake metadata server and how to serve its notice. Adding a cloud is
one module plus one name in :data:`MODULES`.
"""

from __future__ import annotations

import importlib

from spotrun.drill.clouds.base import DrillCloud

#: Modules under ``spotrun.drill.clouds`` whose ``CLOUD`` :func:`clouds` returns, in help order.
MODULES: tuple[str, ...] = ("aws", "gcp", "azure", "sigterm")


def clouds() -> dict[str, type[DrillCloud]]:
    """Every cloud of :data:`MODULES`, by its ``--cloud`` name."""
    found = (importlib.import_module(f"{__name__}.{module}").CLOUD for module in MODULES)
    return {cloud.name: cloud for cloud in found}
