"""Tests of spotrun.train."""
