"""Fake cloud metadata servers for the tests: the implementation lives in
:mod:`spotrun.drill.clouds` (``spotrun drill`` serves its notices from the same fakes)."""

from spotrun.drill.clouds.aws import FakeAws, rfc3339
from spotrun.drill.clouds.azure import FakeAzure, rfc1123
from spotrun.drill.clouds.fake_server import FakeServer, Misbehaviour, Reply, Request
from spotrun.drill.clouds.gcp import FakeGcp

__all__ = ["FakeAws", "FakeAzure", "FakeGcp", "FakeServer", "Misbehaviour", "Reply", "Request", "rfc1123", "rfc3339"]
