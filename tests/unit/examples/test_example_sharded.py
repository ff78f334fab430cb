"""Issue 10, item 5: the example trainer with FSDP2 and tensor parallelism, the global batch,
the ``samples`` digest in its log, and sample-keyed dropout.

The multi-process tests run the real trainer under torchrun (gloo, 2 ranks on 2 CPU cores,
a tiny model) with ``--no-checkpoints``: saving DTensor state is the checkpoint engine's part
of the issue, tested on its own.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch

from spotrun.errors import ConfigError
from spotrun.examples.gpt import GPT, VOCAB_SIZE, GPTConfig
from spotrun.examples.keyed_dropout import SampleKeys
from spotrun.examples.parallel import Layout
from spotrun.examples.samples import IndexedSamples, samples_digest
from spotrun.examples.train_gpt import parse_args
from tests.support.paths import JOBS
from tests.support.trainrun import read_log

WORKER = str(JOBS / "sharded_gpt.py")
TINY_ARGS = [
    "--width",
    "32",
    "--depth",
    "1",
    "--heads",
    "2",
    "--block-size",
    "16",
    "--max-bytes",
    "20000",
    "--steps",
    "6",
    "--warmup-steps",
    "1",
    "--batch-size",
    "4",
    "--log-interval",
    "1000",
    "--intra-op-threads",
    "1",
    "--no-checkpoints",
]
#: Relative tolerance between the losses of two layouts of one run. Layouts add the same
#: numbers in another order (DDP all-reduces gradient buckets, FSDP2 reduce-scatters per
#: unit, tensor parallelism splits the matrix products and sums the halves, the global norm
#: for clipping is summed per shard), so float32 results differ in the last bits (~1e-7
#: relative per operation); over 6 steps of a tiny model they stay far below 1e-5.
LOSS_RTOL = 1e-5


def trainer(nproc: int, log_file, *extra: str) -> subprocess.CompletedProcess:
    """Run the example trainer on ``nproc`` ranks (1: without torchrun); returns the process."""
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        if nproc > 1
        else [sys.executable]
    )
    return subprocess.run(
        [*launcher, "-m", "spotrun.examples.train_gpt", "--log-file", str(log_file), *TINY_ARGS, *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )


def trained(nproc: int, log_file, *extra: str) -> list[dict]:
    done = trainer(nproc, log_file, *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_log(log_file)


def assert_same_run(rows: list[dict], reference: list[dict]) -> None:
    """Same steps, same global batches (digests) and learning rates, losses within LOSS_RTOL."""
    assert [(r["step"], r["samples"], r["lr"]) for r in rows] == [(r["step"], r["samples"], r["lr"]) for r in reference]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference], rel=LOSS_RTOL)


# --- single process ----------------------------------------------------------------------


def test_5_batch_size_is_the_global_batch_split_over_data_parallel_ranks() -> None:
    assert Layout(world_size=1).per_rank_batch(16) == 16
    assert Layout(world_size=2).per_rank_batch(16) == 8
    assert Layout(world_size=2, fsdp=True).per_rank_batch(16) == 8
    assert Layout(world_size=2, tp=2).per_rank_batch(16) == 16  # one data-parallel rank
    assert Layout(world_size=8, tp=2, fsdp=True).per_rank_batch(16) == 4


def test_5_a_global_batch_that_does_not_divide_is_refused_naming_both_numbers() -> None:
    with pytest.raises(ConfigError, match=r"--batch-size 6\).*4 data-parallel ranks"):
        Layout(world_size=4).per_rank_batch(6)
    with pytest.raises(ConfigError, match=r"--batch-size 3\).*2 data-parallel ranks"):
        Layout(world_size=4, tp=2).per_rank_batch(3)


@pytest.mark.parametrize(
    "layout, message",
    [
        (Layout(world_size=3, tp=2), "--tp 2 does not divide the world size 3"),
        (Layout(world_size=4, tp=4), "--tp 4 does not divide --heads 2"),
    ],
    ids=["world-3-tp-2", "heads-2-tp-4"],
)
def test_5_a_tensor_parallel_degree_that_does_not_divide_is_refused(layout: Layout, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        layout.check(heads=2, distributed=True)


def test_5_fsdp_and_tp_without_torchrun_exit_2_before_training(tmp_path) -> None:
    for option in (["--fsdp"], ["--tp", "2"]):
        done = trainer(1, tmp_path / "log.jsonl", *option)
        assert done.returncode == 2
        assert "need a process group: start the trainer with torchrun" in done.stderr
    assert not (tmp_path / "log.jsonl").exists() or read_log(tmp_path / "log.jsonl") == []


def test_5_options_parse() -> None:
    args = parse_args(["--fsdp", "--tp", "2", "--batch-size", "8", "--sample-keyed-dropout"])
    assert (args.fsdp, args.tp, args.batch_size, args.sample_keyed_dropout) == (True, 2, 8, True)
    defaults = parse_args([])
    assert (defaults.fsdp, defaults.tp, defaults.sample_keyed_dropout, defaults.no_checkpoints) == (
        False,
        1,
        False,
        False,
    )
    with pytest.raises(SystemExit):
        parse_args(["--tp", "0"])


def test_5_samples_digest_is_sha256_of_the_sorted_indices() -> None:
    assert samples_digest([12, 3, 7]) == hashlib.sha256(b"3,7,12").hexdigest()[:16]
    assert samples_digest([7, 12, 3]) == samples_digest([3, 7, 12])  # order within the batch is irrelevant
    assert samples_digest([3, 7, 13]) != samples_digest([3, 7, 12])


def test_5_indexed_samples_append_the_dataset_index() -> None:
    data = [(torch.tensor([i]), torch.tensor([i + 1])) for i in range(5)]
    x, y, index = IndexedSamples(data)[3]
    assert (x.item(), y.item(), index) == (3, 4, 3)
    assert len(IndexedSamples(data)) == 5


def test_5_one_line_per_step_has_samples_and_the_old_fields(tmp_path) -> None:
    rows = trained(1, tmp_path / "log.jsonl", "--steps", "4")
    assert [sorted(r) for r in rows] == [["loss", "lr", "samples", "step"]] * 4
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(len(r["samples"]) == 16 and int(r["samples"], 16) >= 0 for r in rows)
    assert len({r["samples"] for r in rows}) == 4  # each step another global batch


def test_5_sample_keyed_dropout_gives_each_sample_its_mask_wherever_it_is_in_the_batch() -> None:
    """One batch of 4 computed whole and as two halves (what 1 and 2 data-parallel ranks do):
    with sample-keyed dropout every sample's logits are the same; with ordinary dropout not."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, width=32, depth=2, heads=4, dropout=0.3)).train()
    idx = torch.randint(0, VOCAB_SIZE, (4, 16))
    samples = [40, 7, 123, 9]
    whole, _ = model(idx, dropout_keys=SampleKeys(seed=1, step=5, sample_indices=samples))
    halves = [model(idx[i : i + 2], dropout_keys=SampleKeys(1, 5, samples[i : i + 2]))[0] for i in (0, 2)]
    torch.testing.assert_close(torch.cat(halves), whole, rtol=1e-5, atol=1e-6)
    other_step, _ = model(idx, dropout_keys=SampleKeys(1, 6, samples))
    assert not torch.allclose(other_step, whole)  # masks change from step to step
    ordinary_halves = [model(idx[i : i + 2])[0] for i in (0, 2)]
    assert not torch.allclose(torch.cat(ordinary_halves), model(idx)[0])


# --- torchrun, 2 ranks (gloo) --------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> list[dict]:
    """The log of a 2-rank DDP run of the tiny model, dropout off (the layouts compared with it
    draw different dropout masks)."""
    return trained(2, tmp_path_factory.mktemp("ddp") / "log.jsonl", "--dropout", "0")


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, layout",
    [
        (2, ["--fsdp"]),
        (2, ["--tp", "2"]),
        (4, ["--fsdp", "--tp", "2"]),  # a (dp 2, tp 2) mesh (it also covers TP with dp > 1 and FSDP2 + TP)
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else f"{v}-ranks",
)
def test_5_sharded_layouts_train_like_ddp(tmp_path, ddp_run, nproc: int, layout: list[str]) -> None:
    """FSDP2, tensor parallel, and both, on 2 ranks and on a 2 x 2 mesh: the same global
    batches as 2-rank DDP with the same seed and --batch-size, losses within LOSS_RTOL, and
    the loss goes down."""
    rows = trained(nproc, tmp_path / "log.jsonl", "--dropout", "0", *layout)
    assert_same_run(rows, ddp_run)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.1


@pytest.mark.slow
def test_5_global_batch_is_the_same_on_1_and_2_ranks(tmp_path, ddp_run) -> None:
    """--batch-size is global: 1 rank with 4 samples per step and 2 ranks with 2 each train on
    the same global batches and (dropout off) the same losses."""
    assert_same_run(trained(1, tmp_path / "one.jsonl", "--dropout", "0"), ddp_run)


@pytest.mark.slow
def test_5_global_batch_not_dividing_over_the_ranks_exits_2_naming_both(tmp_path) -> None:
    done = trainer(2, tmp_path / "log.jsonl", "--batch-size", "3")
    assert done.returncode != 0
    assert "the global batch (--batch-size 3) does not divide by the 2 data-parallel ranks" in done.stderr
    assert read_log(tmp_path / "log.jsonl") == []


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "tp", "fsdp+tp"])
def test_5_sharded_gpt_keeps_the_tied_head_and_trains_like_one_process(tmp_path, mode: str) -> None:
    """The tied head under FSDP2 / TP stays one parameter with the token embedding, and 3
    optimizer steps give the parameters one process gets on the whole global batch: within
    1e-6 absolute (parameters are O(1); only the summation order differs, see LOSS_RTOL)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            WORKER,
            mode,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["tied_before"] and result["tied_after"] and result["parameters_once"]
    assert result["head_equals_embedding"] and result["names_match"]
    assert result["max_abs_param"] > 0.5
    assert max(result["max_abs_diff"].values()) < 1e-6, result["max_abs_diff"]
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=LOSS_RTOL)


@pytest.mark.slow
def test_5_sample_keyed_dropout_gives_the_same_losses_on_1_and_2_ranks(tmp_path) -> None:
    """Dropout on (0.2): with --sample-keyed-dropout, 1 rank, 2 DDP ranks and 2 tensor-parallel
    ranks compute the same losses (within LOSS_RTOL); ordinary dropout on 2 ranks does not."""
    keyed = ["--dropout", "0.2", "--sample-keyed-dropout"]
    one = trained(1, tmp_path / "one.jsonl", *keyed)
    assert_same_run(trained(2, tmp_path / "ddp.jsonl", *keyed), one)
    assert_same_run(trained(2, tmp_path / "tp.jsonl", *keyed, "--tp", "2"), one)
    ordinary = trained(2, tmp_path / "ordinary.jsonl", "--dropout", "0.2")
    # over the run, not at one step: at any one step the two dropout draws may happen to land close
    assert max(abs(o["loss"] - k["loss"]) / k["loss"] for o, k in zip(ordinary, one, strict=True)) > 100 * LOSS_RTOL
