"""Tests of one room of spotrun each (``unit/<room>/``), in one process or a few."""
