"""Tests of spotrun.eventlog."""
