"""Tests of spotrun.tools."""
