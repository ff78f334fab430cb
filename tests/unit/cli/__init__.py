"""Tests of spotrun.cli."""
