"""Tests of spotrun.data."""
