"""Tests of spotrun.state."""
