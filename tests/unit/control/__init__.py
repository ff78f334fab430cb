"""Tests of spotrun.control."""
