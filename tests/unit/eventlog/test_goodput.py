"""The goodput account and the checkpoint-interval advice, on synthetic event logs whose
figures are worked out by hand here (spotrun.eventlog.goodput, spotrun.eventlog.advice)."""

import math

import pytest

from spotrun.eventlog.advice import advise, daly_interval_s, young_interval_s
from spotrun.eventlog.goodput import Accounting, Incarnation, Totals, account, launches


def rec(event, t, **fields):
    return {"event": event, "time_unix_s": t, **fields}


def rank_start(t, restore_s, resumed, launch_incarnation, interval_steps=10, host="node-a"):
    return rec(
        "start",
        t,
        restore_s=restore_s,
        resumed_step=resumed,
        launch_incarnation=launch_incarnation,
        host=host,
        interval_steps=interval_steps,
    )


def save(t, step, stall_s, duration_s, reason="periodic"):
    return rec("save", t, step=step, reason=reason, committed=True, stall_s=stall_s, duration_s=duration_s)


def three_starts():
    """Killed without notice after step 25 (saved 10, 20); resumed from 20, preempted with a
    notice and saved at 28; resumed from 28, finished at 40. One step takes 1 s throughout."""
    supervisors = [
        (
            "supervisor-node-a-00000001",
            0,
            [rec("start", 100, process_started_unix_s=98), rec("launch", 101, incarnation=0)],
        ),  # then SIGKILLed
        (
            "supervisor-node-a-00000002",
            1,
            [
                rec("start", 200, process_started_unix_s=199),
                rec("launch", 201, incarnation=1),
                rec("notice", 215, source="signal", kind="SIGTERM", stop=True),
                rec("command_exit", 218, code=0),
                rec("exit", 218.5, code=143, reason="preempted_saved", step=28),
            ],
        ),
        (
            "supervisor-node-a-00000003",
            2,
            [
                rec("start", 300, process_started_unix_s=299.5),
                rec("launch", 301, incarnation=2),
                rec("command_exit", 320, code=0),
                rec("exit", 320.5, code=0, reason="finished"),
            ],
        ),
    ]
    ranks = {
        0: [
            rank_start(110, 2.0, None, 0),
            save(121, 10, 0.5, 1.0),
            save(131.5, 20, 0.5, 1.0),
            rec("progress", 136, step=25),
        ],
        1: [
            rank_start(205, 1.0, 20, 1),
            save(216, 28, 2.0, 2.0, reason="emergency"),
            rec("stop", 216.1, step=28, saved=True),
            rec("exit", 216.2, step=28),
            rec("progress", 213, step=28),
        ],
        2: [
            rank_start(303, 1.0, 28, 2),
            save(305.5, 30, 0.5, 1.0),
            save(316.5, 40, 0.5, 1.0, reason="final"),
            rec("exit", 317, step=40),
            rec("progress", 315.5, step=40),
        ],
    }
    return ranks, launches(supervisors)


def test_steps_lost_are_the_steps_trained_past_the_next_starts_resume_point():
    ranks, sups = three_starts()
    rows = account(ranks, sups).incarnations
    assert [(r.resumed_step, r.last_step) for r in rows] == [(0, 25), (20, 28), (28, 40)]
    assert [r.steps_trained for r in rows] == [25, 8, 12]
    assert [r.steps_lost for r in rows] == [5, 0, 0]
    assert [r.steps_kept for r in rows] == [20, 8, 12]
    assert [r.ended for r in rows] == ["no_exit_recorded", "preempted_saved", "finished"]


def test_wall_time_runs_from_the_supervisor_process_start_to_its_last_record():
    ranks, sups = three_starts()
    rows = account(ranks, sups).incarnations
    # killed: ends at its last record (progress of step 25 at 136); the others at the supervisor's exit
    assert [r.wall_s for r in rows] == [136 - 98, 218.5 - 199, 320.5 - 299.5]
    assert [r.startup_s for r in rows] == [108 - 98, 204 - 199, 302 - 299.5]
    assert [r.notice_to_exit_s for r in rows] == [None, 218.5 - 215, None]


def test_useful_time_is_the_kept_steps_at_each_starts_step_time_less_save_stalls():
    ranks, sups = three_starts()
    accounting = account(ranks, sups)
    rows, totals = accounting.incarnations, accounting.totals
    # training time: end of restore -> last step, less stalls of saves before it
    assert [r.training_s for r in rows] == [136 - 110 - 1.0, 213 - 205, 315.5 - 303 - 0.5]
    assert [r.step_time_s for r in rows] == [1.0, 1.0, 1.0]
    assert [r.save_stall_s for r in rows] == [1.0, 0.0, 0.5]  # the emergency and final saves come after the last step
    assert totals.useful_s == 20 + 8 + 12
    assert totals.lost_s == 5
    assert totals.wall_s == 38 + 19.5 + 21
    assert totals.goodput == pytest.approx(40 / 78.5)
    assert totals.elapsed_s == 320.5 - 98
    assert (totals.interruptions, totals.unsaved_interruptions) == (2, 1)


def test_the_incarnation_records_resume_points_override_the_start_records():
    ranks, sups = three_starts()
    ranks[1][0] = {**ranks[1][0], "resumed_step": None}  # e.g. a save without restore()
    rows = account(ranks, sups, resumed_steps={0: None, 1: 20, 2: 28}).incarnations
    assert [r.resumed_step for r in rows] == [0, 20, 28]
    assert rows[0].steps_lost == 5


def test_a_library_only_start_counts_from_its_restore_to_its_last_record():
    rows = account(
        {0: [rank_start(10, 2.0, None, None), rec("progress", 20, step=8), rec("exit", 21, step=8)]}, []
    ).incarnations
    assert [(r.wall_s, r.startup_s, r.steps_trained, r.ended) for r in rows] == [(21 - 8, None, 8, "exited")]


def test_two_supervisors_that_planned_the_same_incarnation_are_told_apart_by_time():
    """A pod restarted under the same name (same host, PID 1 both times): the first supervisor
    was killed before training claimed an incarnation, so the second planned the same number."""
    sups = launches(
        [
            (
                "supervisor-pod-0-aaaaaaaa",
                1,
                [rec("start", 100, process_started_unix_s=99), rec("launch", 101, incarnation=1)],
            ),
            (
                "supervisor-pod-0-bbbbbbbb",
                1,
                [
                    rec("start", 200, process_started_unix_s=198),
                    rec("launch", 201, incarnation=1),
                    rec("exit", 260, code=0, reason="finished"),
                ],
            ),
        ]
    )
    ranks = {
        0: [rank_start(50, 1.0, None, 0, host="pod-0"), rec("progress", 90, step=10)],
        2: [rank_start(210, 1.0, 10, 1, host="pod-0"), rec("progress", 250, step=20)],
    }
    rows = account(ranks, sups).incarnations
    assert [(r.number, r.began_unix_s, r.wall_s) for r in rows] == [(0, 49.0, 41.0), (None, 99, 2), (2, 198, 62)]
    assert [r.steps_lost for r in rows] == [0, 0, 0]


def test_young_and_daly_intervals_follow_their_formulas():
    assert young_interval_s(10.0, 9000.0) == pytest.approx(math.sqrt(2 * 10 * 9000))
    ratio = 10 / (2 * 9000)
    assert daly_interval_s(10.0, 9000.0) == pytest.approx(
        math.sqrt(2 * 10 * 9000) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - 10
    )
    assert daly_interval_s(50.0, 20.0) == 20.0  # C >= 2M: checkpoint once per MTBF


def synthetic_accounting(unsaved: int) -> Accounting:
    """Ten hours of wall time, 30,000 steps of 1 s, saves every 100 steps stalling 10 s and
    taking 40 s, ``unsaved`` interruptions that lost work."""
    row = Incarnation(
        number=0,
        host="h",
        began_unix_s=0,
        ended_unix_s=36000,
        wall_s=36000,
        resumed_step=0,
        last_step=30000,
        steps_trained=30000,
        steps_kept=29000,
        steps_lost=1000,
        startup_s=0,
        restore_s=0,
        save_stall_s=300,
        saves=30,
        training_s=30000,
        step_time_s=1.0,
        useful_s=28000,
        lost_s=1000,
        notice_to_exit_s=None,
        ended="finished",
        interval_steps=100,
    )
    totals = Totals(
        incarnations=1,
        wall_s=36000,
        elapsed_s=36000,
        steps_trained=30000,
        steps_lost=1000,
        useful_s=28000,
        lost_s=1000,
        startup_s=0,
        restore_s=0,
        save_stall_s=300,
        notice_to_exit_s=None,
        training_s=30000,
        goodput=28000 / 36000,
        interruptions=10,
        unsaved_interruptions=unsaved,
    )
    return Accounting((row,), totals, tuple(save(0, 100 * k, 10.0, 40.0) for k in range(1, 31)))


def test_interval_advice_uses_the_save_stall_and_the_rate_of_interruptions_that_lost_work():
    advice = advise(synthetic_accounting(unsaved=4))
    mtbf_s = 36000 / 4
    assert advice.mtbf_s == mtbf_s
    assert (advice.save_stall_s, advice.save_duration_s, advice.step_time_s) == (10.0, 40.0, 1.0)
    daly_s = math.sqrt(2 * 10 * mtbf_s) * (1 + math.sqrt(10 / (2 * mtbf_s)) / 3 + 10 / (2 * mtbf_s) / 9) - 10
    assert advice.interval_steps == round(daly_s) == 418
    assert advice.interruptions_per_hour == 1.0 and advice.unsaved_per_hour == 0.4
    # the model: observed stalls and lost time replaced by (T / tau) C + n (tau / 2 + D - C)
    assert advice.goodput_model_suggested == pytest.approx(
        (28000 + 300 + 1000 - 30000 / 418 * 10 - 4 * (418 / 2 + 30)) / 36000
    )
    assert advice.goodput_model_current == pytest.approx(
        (28000 + 300 + 1000 - 30000 / 100 * 10 - 4 * (100 / 2 + 30)) / 36000
    )
    assert advice.goodput_model_suggested > advice.goodput_model_current


def test_no_interval_is_suggested_from_fewer_than_two_interruptions_that_lost_work():
    advice = advise(synthetic_accounting(unsaved=1))
    assert advice.interval_steps is None and advice.goodput_model_suggested is None
    assert advice.reason.startswith("too few interruptions that lost work to estimate their rate: 1")
    assert advice.save_stall_s == 10.0  # the measured cost is still reported


def test_a_background_save_interval_is_never_shorter_than_a_whole_save():
    accounting = synthetic_accounting(unsaved=400)  # an interruption every 90 s: Daly's interval < 40 s
    advice = advise(accounting)
    assert advice.daly_interval_s < 40.0
    assert advice.interval_steps == 40


def test_starts_within_one_launch_split_its_wall_time():
    """torchrun restarting its workers (``--max-restarts``) inside one supervisor launch: each
    start owns the launch's time up to the next one's restore."""
    sups = launches(
        [
            (
                "supervisor-node-a-00000001",
                0,
                [
                    rec("start", 10, process_started_unix_s=9),
                    rec("launch", 11, incarnation=0),
                    rec("command_exit", 80, code=0),
                    rec("exit", 81, code=0, reason="finished"),
                ],
            )
        ]
    )
    ranks = {
        0: [rank_start(20, 1.0, None, 0), save(31, 10, 0.0, 1.0), rec("progress", 35, step=15)],
        1: [rank_start(42, 2.0, 10, 0), rec("progress", 62, step=30), rec("exit", 63, step=30)],
    }
    rows = account(ranks, sups).incarnations
    assert [(r.began_unix_s, r.ended_unix_s, r.startup_s) for r in rows] == [(9, 40, 19 - 9), (40, 81, None)]
    assert [(r.steps_trained, r.steps_lost, r.steps_kept) for r in rows] == [(15, 5, 10), (20, 0, 20)]
    assert [r.ended for r in rows] == ["no_exit_recorded", "finished"]


def test_a_start_whose_rank_0_recorded_no_end_is_a_lower_bound():
    """A start whose rank 0 recorded no end is a lower bound, even when the supervisor saw the exit.

    Rank 0 killed (an OOM, say) after its progress record of step 25, the supervisor records the
    command's exit and restarts it from step 20: the steps trained and lost are lower bounds."""
    ranks, _ = three_starts()
    supervisors = [
        (
            "supervisor-node-a-00000001",
            0,
            [
                rec("start", 100, process_started_unix_s=98),
                rec("launch", 101, incarnation=0),
                rec("command_exit", 140, code=1),
                rec("restart", 140.1, attempt=1, code=1, delay_s=1.0),
                rec("launch", 201, incarnation=1, attempt=1),
                rec("notice", 215, source="signal", kind="SIGTERM", stop=True),
                rec("command_exit", 218, code=0),
                rec("exit", 218.5, code=143, reason="preempted_saved", step=28),
            ],
        )
    ]
    rows = account({0: ranks[0], 1: ranks[1]}, launches(supervisors)).incarnations
    assert [r.steps_lost for r in rows] == [5, 0]
    assert [r.end_recorded for r in rows] == [False, True]


# --- the fast tier: saves to memory and restores from it -----------------------------------------


def memory_save(t, step, stall_s=0.01, duration_s=0.05):
    return {**save(t, step, stall_s, duration_s, reason="memory"), "tier": "memory"}


def crash_resumed_from_memory():
    """Storage every 20 steps, the fast tier every 2: a worker crashed after step 27 (newest in memory:
    26) and the supervisor restarted the command, which read step 26 from memory and finished at 40."""
    supervisors = [
        (
            "supervisor-node-a-00000001",
            0,
            [rec("start", 100, process_started_unix_s=99), rec("launch", 101, incarnation=0)],
        ),
        ("supervisor-node-a-00000001", 1, [rec("launch", 140, incarnation=1)]),
    ]
    ranks = {
        0: [
            rank_start(105, 1.0, None, 0, interval_steps=20),
            save(126, 20, 0.5, 1.0),
            memory_save(126.5, 22),
            memory_save(128.5, 24),
            memory_save(130.5, 26),
            rec("progress", 131.5, step=27),
        ],
        1: [
            {**rank_start(142, 0.5, 26, 1, interval_steps=20), "restore_tier": "memory"},
            save(157, 40, 0.5, 1.0, reason="final"),
            rec("exit", 157.5, step=40),
            rec("progress", 156, step=40),
        ],
    }
    return ranks, launches(supervisors)


def test_a_resume_from_the_fast_tier_loses_only_the_steps_after_its_newest_step():
    ranks, sups = crash_resumed_from_memory()
    rows = account(ranks, sups).incarnations
    assert [(r.resumed_step, r.last_step, r.steps_lost) for r in rows] == [(0, 27, 1), (26, 40, 0)]
    assert [r.restore_tier for r in rows] == [None, "memory"]
    assert [(r.newest_saved_step, r.newest_saved_tier) for r in rows] == [(26, "memory"), (40, "storage")]
    assert [(r.saves, r.memory_saves) for r in rows] == [(1, 3), (1, 0)]


def test_a_fast_tier_step_not_resumed_counts_the_steps_trained_again_from_storage():
    """The tier's step 26 failed verification (or the tier was lost): the restart read step 20 from storage."""
    ranks, sups = crash_resumed_from_memory()
    ranks[1][0] = {**ranks[1][0], "resumed_step": 20, "restore_tier": "storage"}
    rows = account(ranks, sups).incarnations
    assert rows[0].steps_lost == 7
    assert (rows[0].newest_saved_step, rows[0].newest_saved_tier, rows[1].restore_tier) == (26, "memory", "storage")


def test_fast_tier_saves_stall_training_but_do_not_count_as_periodic_saves_for_the_interval():
    ranks, sups = crash_resumed_from_memory()
    accounting = account(ranks, sups)
    assert accounting.incarnations[0].save_stall_s == pytest.approx(0.5 + 3 * 0.01)
    assert [r["step"] for r in accounting.saves] == [20]
