"""Fixtures shared by the end-to-end tests."""

import pytest

from tests.trainrun import kill_tree


@pytest.fixture
def processes():
    """Supervisors started by a test; any still running at the end are killed with their trees."""
    started = []
    yield started
    for proc in started:
        kill_tree(proc)
