"""The checkpoint format and engine: the manifest and layout, planning and writing shards,
background saves, reading and verifying them, the catalog of steps, fencing and retention.

Imports torch. May import tools, control and storage.
"""
