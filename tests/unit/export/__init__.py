"""Tests of spotrun.export."""
