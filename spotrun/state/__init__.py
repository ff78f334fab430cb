"""Turning training state (optimizer, RNGs, numerics, user objects) into tensors plus JSON, and
back, without pickle.

Imports torch. May import tools, control, storage and checkpoint.
"""
