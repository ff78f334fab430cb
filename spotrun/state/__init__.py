"""Turning training state into tensors plus JSON, and back, without pickle."""
