"""Exporting a checkpoint for other tools: the plan of what to write (:mod:`.plan`) and the Hugging
Face sharded safetensors writer (:mod:`.hf`).

Imports torch. May import tools, control, storage, state and checkpoint.
"""
