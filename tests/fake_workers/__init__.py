"""Fake launch commands for the supervisor tests (run as scripts, not imported by spotrun)."""
