"""Tests of spotrun.notices."""
