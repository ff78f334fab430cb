"""Fixtures of the storage tests."""

import pytest

from tests.support.fault_proxy import FaultProxy


@pytest.fixture
def proxy(s3_bucket, request):
    """A fault proxy (tests/support/fault_proxy.py) in front of the test's bucket; its random
    choices are seeded by the test module's ``PROXY_SEED`` (0, FaultProxy's default, if none)."""
    with FaultProxy(s3_bucket.endpoint_url, seed=getattr(request.module, "PROXY_SEED", 0)) as started:
        yield started
