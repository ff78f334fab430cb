"""Tests of spotrun.storage."""
