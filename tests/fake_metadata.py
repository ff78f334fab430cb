"""Fake cloud metadata servers for the tests: the implementation lives in
:mod:`spotrun.drill_fakes` (``spotrun drill`` serves its notices from the same fakes)."""

from spotrun.drill_fakes import (  # noqa: F401  (re-exported for the tests)
    FakeAws,
    FakeAzure,
    FakeGcp,
    FakeServer,
    Misbehaviour,
    Reply,
    Request,
    rfc1123,
    rfc3339,
)
