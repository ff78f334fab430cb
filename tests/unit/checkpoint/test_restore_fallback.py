"""The verdict on a step that every rank tried to load (the multi-rank fallback of a restore),
table-tested from plain inputs: what each rank reported, indexed by rank."""

from __future__ import annotations

import pytest

from spotrun.checkpoint.verdict import StepVerdict, judge

CORRUPT = {"corrupt": True, "message": "shard 1: checksum mismatch"}
MISSING = {"corrupt": False, "message": "ObjectNotFoundError: no such key"}
MISMATCH = {"corrupt": False, "mismatch": True, "message": "tensor 'w' has shape [4] in the checkpoint and [5] here"}

# (name, every rank's problem, expected verdict)
VERDICTS = [
    ("every rank loaded it: use it", [None, None, None], StepVerdict(failures={})),
    (
        "one rank found a corrupt file: all fall back, and the step is un-committed",
        [None, CORRUPT, None],
        StepVerdict(failures={1: CORRUPT["message"]}, corrupt=True),
    ),
    (
        "one rank could not read a file: all fall back, the step stays committed",
        [MISSING, None],
        StepVerdict(failures={0: MISSING["message"]}),
    ),
    (
        "several ranks failed: each is named",
        [MISSING, CORRUPT],
        StepVerdict(failures={0: MISSING["message"], 1: CORRUPT["message"]}, corrupt=True),
    ),
    (
        "the step does not fit this job on one rank: every rank refuses, no fallback",
        [None, MISMATCH, CORRUPT],
        StepVerdict(
            failures={1: MISMATCH["message"], 2: CORRUPT["message"]}, mismatch=MISMATCH["message"], corrupt=True
        ),
    ),
]


@pytest.mark.parametrize("problems, expected", [case[1:] for case in VERDICTS], ids=[case[0] for case in VERDICTS])
def test_judge_answers_each_case_of_the_table(problems, expected):
    verdict = judge(problems)
    assert verdict == expected
    assert verdict.loads is (not expected.failures)
