"""Sharded checkpoint format: layout, planning, writing, reading and the catalog of steps."""
