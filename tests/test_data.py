"""Exact-resume data order: spotrun.data's sampler and loader (single process; ranks simulated)."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset

from spotrun.data import ResumableDataLoader, ResumableDistributedSampler
from spotrun.errors import ConfigError, StateMismatchError


class Ids(Dataset):
    """Sample i is the int i, so a batch shows which samples it holds."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


class NoisyIds(Ids):
    """Sample i is (i, a draw from the loading process's torch RNG), like a random augmentation."""

    def __getitem__(self, index: int) -> tuple[int, float]:
        return index, torch.rand(()).item()


def make_loader(length=23, batch_size=4, num_workers=0, **kwargs) -> ResumableDataLoader:
    if num_workers:
        kwargs.setdefault("multiprocessing_context", "fork")
    return ResumableDataLoader(Ids(length), batch_size, num_workers=num_workers, seed=7, **kwargs)


def run_loop(loader, max_steps, step=0, stop_after=None):
    """The training loop of the Checkpointer docs, with a per-epoch hook after the inner loop.

    Returns (ids by step, steps at which the per-epoch hook ran, state saved at stop_after or None).
    """
    ids, epoch_ends = {}, []
    while step < max_steps:
        for batch in loader:
            step += 1
            ids[step] = batch.tolist()
            if step == stop_after:  # the emergency save, then exit
                return ids, epoch_ends, json.loads(json.dumps(loader.state_dict()))
            if step >= max_steps:
                break
        else:
            epoch_ends.append(step)  # e.g. a per-epoch scheduler.step()
    return ids, epoch_ends, None


def rank_epoch(length, num_replicas, rank, epoch, **kwargs) -> list[int]:
    sampler = ResumableDistributedSampler(length, num_replicas, rank, **kwargs)
    sampler.set_epoch(epoch)
    return list(sampler)


# --- sampler ---------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [10, 11])
@pytest.mark.parametrize("num_replicas", [1, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_sampler_gives_the_order_of_torch_distributed_sampler(
    length, num_replicas, shuffle, drop_last
):
    for rank in range(num_replicas):
        theirs = DistributedSampler(
            Ids(length), num_replicas, rank, shuffle=shuffle, seed=3, drop_last=drop_last
        )
        ours = ResumableDistributedSampler(
            length, num_replicas, rank, shuffle=shuffle, seed=3, drop_last=drop_last
        )
        assert len(ours) == len(theirs)
        for epoch in range(3):
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(theirs)


@pytest.mark.parametrize("drop_last", [True, False])
def test_every_epoch_the_ranks_cover_the_dataset_once(drop_last):
    length, num_replicas = 10, 4
    for epoch in range(4):
        shares = [
            rank_epoch(length, num_replicas, r, epoch, drop_last=drop_last)
            for r in range(num_replicas)
        ]
        assert len({len(share) for share in shares}) == 1, "ranks must get equal shares"
        counts = Counter(i for share in shares for i in share)
        if drop_last:
            assert max(counts.values()) == 1
            assert len(counts) == length - length % num_replicas
        else:
            assert set(counts) == set(range(length))
            padding = len(shares[0]) * num_replicas - length
            assert sum(c - 1 for c in counts.values()) == padding


def test_epochs_have_different_orders():
    orders = [tuple(rank_epoch(50, 2, 0, epoch)) for epoch in range(4)]
    assert len(set(orders)) == 4
    assert set(orders[0]) != set(rank_epoch(50, 2, 1, 0))


def test_sampler_start_index_yields_the_rest_of_the_epoch():
    sampler = ResumableDistributedSampler(31, num_replicas=2, rank=1, seed=5)
    sampler.set_epoch(2)
    whole = list(sampler)
    sampler.set_position(2, 6)
    assert list(sampler) == whole[6:]
    sampler.set_position(2, len(sampler))
    assert list(sampler) == []


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ConfigError):
        ResumableDistributedSampler(10, num_replicas=2, rank=2)
    with pytest.raises(ConfigError):
        ResumableDistributedSampler(-1)
    with pytest.raises(ConfigError):
        ResumableDistributedSampler(10).set_position(0, 11)


# --- loader: exact resume ------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("num_replicas", "rank"), [(1, 0), (3, 2)])
def test_resume_mid_epoch_continues_with_exactly_the_next_batch(num_workers, num_replicas, rank):
    kwargs = dict(num_workers=num_workers, num_replicas=num_replicas, rank=rank)
    per_epoch = len(make_loader(**kwargs))
    max_steps = 3 * per_epoch
    stop = per_epoch + 1  # inside epoch 1, while workers have batches prefetched
    reference, ref_ends, _ = run_loop(make_loader(**kwargs), max_steps)

    first, ends_1, state = run_loop(make_loader(**kwargs), max_steps, stop_after=stop)
    assert state["epoch"] == 1 and state["batches_consumed"] == 1
    resumed_loader = make_loader(**kwargs)
    resumed_loader.load_state_dict(state)
    rest, ends_2, _ = run_loop(resumed_loader, max_steps, step=stop)

    assert {**first, **rest} == reference
    assert ends_1 + ends_2 == ref_ends


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_right_after_the_last_batch_of_an_epoch(num_workers):
    per_epoch = len(make_loader(num_workers=num_workers))
    max_steps = 3 * per_epoch
    reference, ref_ends, _ = run_loop(make_loader(num_workers=num_workers), max_steps)

    first, ends_1, state = run_loop(
        make_loader(num_workers=num_workers), max_steps, stop_after=per_epoch
    )
    assert (state["epoch"], state["batches_consumed"]) == (0, per_epoch)
    assert ends_1 == [], "saved before the per-epoch hook ran"
    loader = make_loader(num_workers=num_workers)
    loader.load_state_dict(state)
    rest, ends_2, _ = run_loop(loader, max_steps, step=per_epoch)

    assert {**first, **rest} == reference
    assert ends_1 + ends_2 == ref_ends, "the per-epoch hook runs exactly once for epoch 0"
    assert loader.epoch == 2 and loader.batches_consumed == per_epoch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_field_case_c01_preempt_inside_epoch_1(num_workers):
    def loader():
        return ResumableDataLoader(
            Ids(10), batch_size=2, shuffle=True, seed=1234, num_workers=num_workers,
            **({"multiprocessing_context": "fork"} if num_workers else {}),
        )

    uninterrupted, _, _ = run_loop(loader(), max_steps=15)
    before, _, state = run_loop(loader(), max_steps=15, stop_after=7)
    resumed = loader()
    resumed.load_state_dict(state)
    after, _, _ = run_loop(resumed, max_steps=15, step=7)

    assert sorted(after) == list(range(8, 16))
    assert {s: after[s] for s in range(8, 16)} == {s: uninterrupted[s] for s in range(8, 16)}
    combined = {**before, **after}
    for epoch in (1, 2):
        seen = [i for step in range(5 * epoch + 1, 5 * epoch + 6) for i in combined[step]]
        assert sorted(seen) == list(range(10))


def test_len_counts_batches_per_epoch_per_rank():
    for drop_last in (True, False):
        loader = make_loader(length=23, batch_size=4, num_replicas=3, rank=1, drop_last=drop_last)
        batches = list(loader)
        assert len(loader) == len(batches)
        assert loader.epoch == 1 and loader.batches_consumed == 0
        if drop_last:
            assert all(len(b) == 4 for b in batches)


def test_a_new_iterator_takes_over_from_an_abandoned_one():
    loader = make_loader()
    old = iter(loader)
    first = next(old).tolist()
    assert loader.batches_consumed == 1
    reference = [b.tolist() for b in make_loader()]
    assert [first] + [b.tolist() for b in loader] == reference
    assert list(old) == []


# --- loader: randomness --------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterating_leaves_the_global_rngs_untouched(num_workers):
    loader = make_loader(num_workers=num_workers)
    torch_before, python_before = torch.get_rng_state(), random.getstate()
    iterator = iter(loader)
    next(iterator)
    assert torch.equal(torch.get_rng_state(), torch_before)
    for _ in range(2):
        list(loader)
    assert torch.equal(torch.get_rng_state(), torch_before)
    assert random.getstate() == python_before


def test_worker_random_streams_depend_only_on_seed_and_epoch():
    def two_epochs():
        loader = ResumableDataLoader(
            NoisyIds(12), 3, seed=4, num_workers=2, multiprocessing_context="fork"
        )
        return [[b for b in loader] for _ in range(2)]

    torch.manual_seed(1)
    first = two_epochs()
    torch.manual_seed(2)
    second = two_epochs()
    for epoch in range(2):
        for a, b in zip(first[epoch], second[epoch]):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(first[0][0][1], first[1][0][1])

    resumed = ResumableDataLoader(
        NoisyIds(12), 3, seed=4, num_workers=2, multiprocessing_context="fork"
    )
    resumed.load_state_dict({**resumed.state_dict(), "epoch": 1})
    for a, b in zip(resumed, first[1]):
        assert torch.equal(a[1], b[1])


# --- state_dict ----------------------------------------------------------------------------------


def test_state_dict_is_json_and_identical_on_every_rank():
    states = []
    for rank in range(4):
        loader = make_loader(num_replicas=4, rank=rank)
        iterator = iter(loader)
        next(iterator)
        next(iterator)
        states.append(loader.state_dict())
    assert all(state == states[0] for state in states)
    assert json.loads(json.dumps(states[0])) == states[0]
    assert states[0]["batches_consumed"] == 2


def saved_state(**changes):
    loader = make_loader(num_replicas=4, rank=0)
    next(iter(loader))
    state = loader.state_dict()
    state.update(changes)
    return state


@pytest.mark.parametrize(
    ("loader_kwargs", "expected"),
    [
        (dict(num_replicas=2, rank=0), "world size 4, now 2"),
        (dict(num_replicas=4, rank=0, length=24), "dataset_len was 23 when saved, now 24"),
        (dict(num_replicas=4, rank=0, batch_size=2), "batch_size was 4 when saved, now 2"),
        (dict(num_replicas=4, rank=0, shuffle=False), "shuffle"),
    ],
)
def test_load_refuses_a_different_world_size_dataset_or_batch_size(loader_kwargs, expected):
    loader = make_loader(**loader_kwargs)
    with pytest.raises(StateMismatchError, match=expected):
        loader.load_state_dict(saved_state())
    assert loader.epoch == 0 and loader.batches_consumed == 0


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ({k: v for k, v in saved_state().items() if k != "epoch"}, "lacks the field 'epoch'"),
        (saved_state(epoch="1"), "'epoch'"),
        (saved_state(batches_consumed=True), "'batches_consumed'"),
        (saved_state(batches_consumed=99), "outside an epoch"),
        (saved_state(extra=1), "unknown fields"),
    ],
)
def test_load_refuses_malformed_state(state, expected):
    with pytest.raises(StateMismatchError, match=expected):
        make_loader(num_replicas=4, rank=0).load_state_dict(state)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(sampler=DistributedSampler(Ids(5), 1, 0)),
        dict(batch_sampler=[[0, 1]]),
        dict(generator=torch.Generator()),
    ],
)
def test_loader_rejects_its_own_sampler_arguments(kwargs):
    with pytest.raises(ConfigError, match="makes its own sampler"):
        ResumableDataLoader(Ids(5), 2, **kwargs)


def test_loader_rejects_iterable_datasets():
    with pytest.raises(ConfigError, match="map-style"):
        ResumableDataLoader(Stream(), 2)


def test_loader_workers_survive_a_sigterm_from_outside(tmp_path):
    """C09's root cause: torch's loader workers die on a SIGTERM that is not from their parent
    (torchrun's killpg, a VM shutdown), and the rank then raises instead of saving."""
    import multiprocessing
    import subprocess

    loader = ResumableDataLoader(list(range(40)), batch_size=2, shuffle=False, num_workers=2)
    batches = iter(loader)
    got = [next(batches).tolist()]
    worker_pids = [c.pid for c in multiprocessing.active_children()]
    assert len(worker_pids) == 2
    for pid in worker_pids:  # sent by another process, as torchrun or systemd would
        subprocess.run(["kill", "-TERM", str(pid)], check=True)
    got += [b.tolist() for b in batches]
    assert [i for b in got for i in b] == list(range(40))
