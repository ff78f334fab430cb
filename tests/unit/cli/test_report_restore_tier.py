"""`spotrun report` as text: where each start restored from (the fast tier or storage)."""

from spotrun.cli.report import render
from spotrun.eventlog.advice import advise
from spotrun.eventlog.goodput import account
from tests.unit.eventlog.test_goodput import crash_resumed_from_memory, three_starts


def test_the_report_shows_where_each_start_restored_from_when_one_read_the_fast_tier():
    ranks, sups = crash_resumed_from_memory()
    accounting = account(ranks, sups)
    header, first, second, _total = render("/ck", accounting, advise(accounting)).splitlines()[2:6]
    column = header.index("FROM")
    assert header.split()[8:10] == ["RESTORE", "FROM"]
    assert (first[column:].split()[0], second[column:].split()[0]) == ("-", "memory")


def test_the_report_of_a_run_without_a_fast_tier_has_no_from_column():
    ranks, sups = three_starts()
    accounting = account(ranks, sups)
    header = render("/ck", accounting, advise(accounting)).splitlines()[2]
    assert "FROM" not in header and header.split()[8:10] == ["RESTORE", "SAVE"]
