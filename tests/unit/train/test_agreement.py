"""The per-step agreement, immediate and pipelined (issue 26, point 5), against a recorded all-reduce.

Several ranks deciding the same at the same step under a pipelined agreement, and resuming
exactly, is shown with real processes by tests/e2e/test_multinode.py (parametrized by agreement).
"""

from __future__ import annotations

import pytest

from spotrun.errors import ConfigError
from spotrun.train import agreement as agreement_module
from spotrun.train.agreement import Agreement, Flags, pipelines
from spotrun.train.options import CheckpointerOptions


class Started:
    """A started all-reduce whose result is the flags it was started with (one rank's view)."""

    def __init__(self, values: list[bool], log: list) -> None:
        self.values, self.log = values, log

    def wait(self) -> list[bool]:
        self.log.append(("wait", self.values))
        return self.values


@pytest.fixture
def started(monkeypatch) -> list:
    log: list = []

    def start(values, *, timeout_s, what):
        log.append(("start", list(values), what))
        return Started(list(values), log)

    monkeypatch.setattr(agreement_module.dist, "start_any_rank_each", start)
    return log


def flags(*, stop: bool = False, save_running: bool = False, save_in_flight: object = None) -> Flags:
    return Flags(stop, False, False, False, save_running, False, save_in_flight, None)


def test_immediate_agrees_at_the_look_with_the_flags_of_that_look(started):
    agreement = Agreement(pipelined=False)
    agreed = agreement.look(lambda: flags(stop=True), None, None, timeout_s=5, what="look 1")
    assert agreed is not None and agreed.save_and_stop
    agreement.start_next(flags(), timeout_s=5, what="unused")  # nothing to start: the look waited
    assert [entry[0] for entry in started] == ["start", "wait"]


def test_pipelined_reads_at_each_look_what_the_previous_look_started(started):
    """A request seen at one look is acted on at the next, by every rank alike."""
    agreement = Agreement(pipelined=True)
    assert (
        agreement.look(lambda: pytest.fail("pipelined: no flags at the look"), None, None, timeout_s=5, what="1")
        is None
    )
    agreement.start_next(flags(stop=True), timeout_s=5, what="started at 1")
    agreed = agreement.look(lambda: flags(), None, None, timeout_s=5, what="2")
    assert agreed is not None and agreed.save_and_stop
    assert agreement.look(lambda: flags(), None, None, timeout_s=5, what="3") is None  # read once


def test_a_save_started_after_the_flags_were_taken_is_not_reported_as_ended(started):
    """The flags said no save was being written; a save that started since is unknown to them
    (None: the caller asks again), never taken as ended."""
    agreement = Agreement(pipelined=True)
    before, after = object(), object()
    agreement.start_next(flags(save_running=False, save_in_flight=before), timeout_s=5, what="started at 1")
    agreed = agreement.look(lambda: flags(), after, None, timeout_s=5, what="2")
    assert agreed is not None and agreed.save_running is None
    agreement.start_next(flags(save_running=False, save_in_flight=after), timeout_s=5, what="started at 2")
    agreed = agreement.look(lambda: flags(), after, None, timeout_s=5, what="3")
    assert agreed is not None and agreed.save_running is False  # the same save: ended on every rank


def test_a_stop_drops_the_started_all_reduce(started):
    agreement = Agreement(pipelined=True)
    agreement.start_next(flags(stop=True), timeout_s=5, what="started at 1")
    agreement.drop()
    assert agreement.look(lambda: flags(), None, None, timeout_s=5, what="2") is None


def test_auto_pipelines_from_64_ranks_and_never_in_one_process():
    assert [pipelines("auto", n) for n in (1, 2, 63, 64, 1024)] == [False, False, False, True, True]
    assert [pipelines("pipelined", n) for n in (1, 2)] == [False, True]
    assert not pipelines("immediate", 8192)


def test_an_unknown_agreement_is_refused_where_it_is_given(monkeypatch):
    with pytest.raises(ConfigError, match="agreement must be one of"):
        CheckpointerOptions(agreement="sometimes")
    monkeypatch.setenv("SPOTRUN_AGREEMENT", "sometimes")
    from spotrun.control.env import WorkerEnv

    with pytest.raises(ConfigError, match="agreement must be one of"):
        CheckpointerOptions().with_timeouts(WorkerEnv.from_environ())
