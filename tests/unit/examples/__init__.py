"""Tests of spotrun.examples."""
