"""Tests of spotrun.supervisor."""
