"""Tests of spotrun.checkpoint."""
