"""Exact-resume data order: spotrun.data.loader's sampler and loader (single process; ranks simulated)."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections import Counter

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset

from spotrun.data.loader import ResumableDataLoader, ResumableDistributedSampler, samples_digest
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
    kwargs.setdefault("seed", 7)
    return ResumableDataLoader(Ids(length), batch_size, num_workers=num_workers, **kwargs)


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
def test_sampler_gives_the_order_of_torch_distributed_sampler(length, num_replicas, shuffle, drop_last):
    for rank in range(num_replicas):
        theirs = DistributedSampler(Ids(length), num_replicas, rank, shuffle=shuffle, seed=3, drop_last=drop_last)
        ours = ResumableDistributedSampler(length, num_replicas, rank, shuffle=shuffle, seed=3, drop_last=drop_last)
        assert len(ours) == len(theirs)
        for epoch in range(3):
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(theirs)


@pytest.mark.parametrize("drop_last", [True, False])
def test_every_epoch_the_ranks_cover_the_dataset_once(drop_last):
    length, num_replicas = 10, 4
    for epoch in range(4):
        shares = [rank_epoch(length, num_replicas, r, epoch, drop_last=drop_last) for r in range(num_replicas)]
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
    global_batch = 4 * num_replicas
    assert state["epoch"] == 1 and state["global_samples_consumed"] == global_batch
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

    first, ends_1, state = run_loop(make_loader(num_workers=num_workers), max_steps, stop_after=per_epoch)
    assert (state["epoch"], state["global_samples_consumed"]) == (0, per_epoch * 4)
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
            Ids(10),
            batch_size=2,
            shuffle=True,
            seed=1234,
            num_workers=num_workers,
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


def test_len_counts_batches_per_epoch_per_rank_and_every_batch_is_full():
    for drop_last in (True, False):
        loader = make_loader(length=23, batch_size=4, num_replicas=3, rank=1, drop_last=drop_last)
        batches = list(loader)
        assert len(loader) == len(batches) == (1 if drop_last else 2)
        assert loader.epoch == 1 and loader.batches_consumed == 0
        assert all(len(b) == 4 for b in batches)  # without drop_last the tail is padded


def test_a_new_iterator_takes_over_from_an_abandoned_one():
    loader = make_loader()
    old = iter(loader)
    first = next(old).tolist()
    assert loader.batches_consumed == 1
    reference = [b.tolist() for b in make_loader()]
    assert [first] + [b.tolist() for b in loader] == reference
    assert list(old) == []


# --- global order: the same global batches at every world size -----------------------------------

GLOBAL_BATCH = 12  # divides by world sizes 1, 2, 3, 4, 6


def world_loaders(world, length=37, **kwargs):
    kwargs.setdefault("seed", 11)
    if kwargs.get("num_workers"):
        kwargs.setdefault("multiprocessing_context", "fork")
    return [
        ResumableDataLoader(Ids(length), global_batch_size=GLOBAL_BATCH, num_replicas=world, rank=rank, **kwargs)
        for rank in range(world)
    ]


def run_world(world, max_steps, *, state=None, step=0, stop_after=None, **kwargs):
    """Every rank of a simulated world runs the training loop of run_loop on its own loader.

    Returns (global batch by step: the ranks' batches put back in global order, i.e. rank r's
    j-th sample at position r + j*world; steps at which the per-epoch hook ran; the state saved
    at stop_after). Checks on the way that all ranks agree on the hook steps and the saved state,
    and that every rank's last_global_batch() is the global batch its ranks actually yielded.
    """
    per_rank, ends, states, last = [], [], [], []
    for loader in world_loaders(world, **kwargs):
        if state is not None:
            loader.load_state_dict(state)
        ids, rank_ends, lasts, rank_state = {}, [], {}, None
        at = step
        while at < max_steps and rank_state is None:
            for batch in loader:
                at += 1
                ids[at] = batch.tolist()
                lasts[at] = loader.last_global_batch()
                if at == stop_after:
                    rank_state = json.loads(json.dumps(loader.state_dict()))
                    break
                if at >= max_steps:
                    break
            else:
                rank_ends.append(at)
        per_rank.append(ids)
        ends.append(rank_ends)
        states.append(rank_state)
        last.append(lasts)
    assert all(e == ends[0] for e in ends) and all(s == states[0] for s in states)
    assert all(lasts == last[0] for lasts in last), "last_global_batch differs between ranks"
    global_batches = {}
    for at in per_rank[0]:
        batch = [None] * GLOBAL_BATCH
        for rank in range(world):
            batch[rank::world] = per_rank[rank][at]
        global_batches[at] = batch
    assert global_batches == last[0], "last_global_batch is not what the ranks yielded"
    return global_batches, ends[0], states[0]


def spec_epoch_order(epoch, length=37, seed=11, drop_last=False):
    """Epoch `epoch` as documented: randperm from seed + epoch, padded from its start or cut."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    order = torch.randperm(length, generator=generator).tolist()
    if drop_last:
        return order[: length // GLOBAL_BATCH * GLOBAL_BATCH]
    return (order * 2)[: -(-length // GLOBAL_BATCH) * GLOBAL_BATCH]


@pytest.mark.parametrize("drop_last", [False, True])
def test_uninterrupted_global_batches_are_the_same_at_world_size_1_2_4(drop_last):
    runs = {world: run_world(world, 9, drop_last=drop_last) for world in (1, 2, 4)}
    batches_1, ends_1, _ = runs[1]
    for world in (2, 4):
        batches, ends, _ = runs[world]
        assert batches == batches_1  # the same global batches, even in the same order
        assert ends == ends_1
    per_epoch = 3 if drop_last else 4
    for epoch in range(2):
        steps = range(epoch * per_epoch + 1, (epoch + 1) * per_epoch + 1)
        epoch_samples = [i for s in steps for i in batches_1[s]]
        assert epoch_samples == spec_epoch_order(epoch, drop_last=drop_last)


def test_tail_padding_is_the_same_at_every_world_size():
    order = spec_epoch_order(0)[:37]
    expected_tail = order[36:] + order[:11]  # 1 leftover sample, filled up from the epoch's start
    for world in (1, 2, 3, 4, 6):
        batches, _, _ = run_world(world, 4)
        assert batches[4] == expected_tail, f"world size {world}"


def test_full_batches_keep_the_order_of_torch_distributed_sampler():
    """What changed from spotrun's first order: only the last batch, now filled to batch_size."""
    for rank in range(3):
        theirs = list(DistributedSampler(Ids(19), 3, rank, shuffle=True, seed=7))
        theirs = [theirs[i : i + 4] for i in range(0, len(theirs), 4)]
        ours = [b.tolist() for b in make_loader(length=19, batch_size=4, num_replicas=3, rank=rank)]
        assert len(ours) == len(theirs) == 2
        assert ours[0] == theirs[0]
        assert ours[1][: len(theirs[1])] == theirs[1] and len(theirs[1]) < len(ours[1]) == 4


@pytest.mark.parametrize(
    ("saved_world", "new_world", "num_workers"),
    [(4, 2, 0), (4, 3, 0), (2, 4, 0), (4, 3, 2)],
    ids=["4-to-2", "4-to-3", "2-to-4", "4-to-3-workers"],
)
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_at_another_world_size_consumes_the_rest_of_the_epoch_once(
    saved_world, new_world, num_workers, drop_last
):
    """A resume at another world size consumes the rest of the epoch once, in the same global
    batches."""
    kwargs = dict(drop_last=drop_last, num_workers=num_workers)
    per_epoch = 3 if drop_last else 4
    max_steps = 3 * per_epoch
    stop = per_epoch + 2  # two global batches into epoch 1
    reference, ref_ends, _ = run_world(saved_world, max_steps, **kwargs)

    first, ends_1, state = run_world(saved_world, max_steps, stop_after=stop, **kwargs)
    assert state["global_samples_consumed"] == 2 * GLOBAL_BATCH
    rest, ends_2, _ = run_world(new_world, max_steps, state=state, step=stop, **kwargs)

    assert sorted(rest) == list(range(stop + 1, max_steps + 1))
    assert {**first, **rest} == reference
    assert ends_1 + ends_2 == ref_ends
    epoch_1 = range(per_epoch + 1, 2 * per_epoch + 1)
    before = Counter(i for s in epoch_1 if s <= stop for i in first[s])
    after = Counter(i for s in epoch_1 if s > stop for i in rest[s])
    assert before + after == Counter(spec_epoch_order(1, drop_last=drop_last))
    if drop_last:  # no padding: each sample exactly once, none of them again after the resume
        assert max((before + after).values()) == 1 and not set(before) & set(after)


def test_a_global_batch_that_does_not_divide_by_the_new_world_size_names_both_numbers():
    _, _, state = run_world(4, 9, stop_after=5)
    with pytest.raises(ConfigError, match="global batch 12 does not divide by world size 5"):
        world_loaders(5)
    loader = ResumableDataLoader(Ids(37), 2, seed=11, num_replicas=5, rank=0)
    with pytest.raises(StateMismatchError, match="global batch 12 does not divide by world size 5"):
        loader.load_state_dict(state)


def test_another_global_batch_size_is_refused_at_a_new_world_size():
    _, _, state = run_world(4, 9, stop_after=5)
    loader = ResumableDataLoader(Ids(37), 3, seed=11, num_replicas=2, rank=1)
    with pytest.raises(StateMismatchError) as caught:
        loader.load_state_dict(state)
    assert "global batch size was 12 when saved, now 6" in str(caught.value)
    assert "global_batch_size=12" in str(caught.value)  # how to keep the order
    assert loader.epoch == 0 and loader.batches_consumed == 0


def test_global_batch_size_sets_the_per_rank_batch():
    loader = ResumableDataLoader(Ids(37), global_batch_size=12, num_replicas=4, rank=3)
    assert (loader.batch_size, loader.global_batch_size) == (3, 12)
    assert ResumableDataLoader(Ids(37), 3, num_replicas=4, rank=3).global_batch_size == 12
    assert ResumableDataLoader(Ids(37)).batch_size == 1
    with pytest.raises(ConfigError, match="global batch 10 does not divide by world size 3"):
        ResumableDataLoader(Ids(37), global_batch_size=10, num_replicas=3, rank=0)
    with pytest.raises(ConfigError, match="not both"):
        ResumableDataLoader(Ids(37), 3, global_batch_size=12, num_replicas=4, rank=0)
    for bad in (0, -12, 12.0, True):
        with pytest.raises(ConfigError, match="global_batch_size must be a positive int"):
            ResumableDataLoader(Ids(37), global_batch_size=bad)


def test_a_world_size_change_is_logged_in_one_line(caplog):
    _, _, state = run_world(4, 9, stop_after=6)
    with caplog.at_level(logging.INFO, logger="spotrun.data.loader"):
        world_loaders(4)[0].load_state_dict(state)
        assert caplog.messages == []
        world_loaders(2)[1].load_state_dict(state)
    assert caplog.messages == ["data order: resuming epoch 1 at global sample 24, saved at world size 4, now 2"]


def version_1_state(**changes):
    """A state as spotrun's first data order saved it (per-rank batches consumed)."""
    state = {
        "version": 1,
        "epoch": 1,
        "batches_consumed": 2,
        "seed": 11,
        "num_replicas": 4,
        "batch_size": 3,
        "dataset_len": 37,
        "shuffle": True,
        "drop_last": False,
    }
    return {**state, **changes}


@pytest.mark.parametrize("new_world", [4, 2, 3])
def test_version_1_state_still_loads(new_world):
    reference, _, _ = run_world(4, 12)
    loader = world_loaders(new_world)[0]
    loader.load_state_dict(version_1_state())
    assert loader.state_dict() == {
        "version": 2,
        "epoch": 1,
        "global_samples_consumed": 24,
        "seed": 11,
        "global_batch_size": 12,
        "dataset_len": 37,
        "shuffle": True,
        "drop_last": False,
        "world_size": new_world,
    }
    rest, _, _ = run_world(new_world, 12, state=version_1_state(), step=6)
    assert rest == {s: reference[s] for s in range(7, 13)}


def test_version_1_state_with_another_global_batch_is_refused():
    with pytest.raises(StateMismatchError, match="global batch size was 8 when saved, now 12"):
        world_loaders(2)[0].load_state_dict(version_1_state(batch_size=2))
    with pytest.raises(StateMismatchError, match="'batches_consumed'"):
        world_loaders(4)[0].load_state_dict(version_1_state(batches_consumed=-1))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_last_global_batch_and_samples_digest_match_what_the_ranks_yielded(num_workers):
    world = 3
    loaders = world_loaders(world, num_workers=num_workers)
    assert all(loader.last_global_batch() == [] for loader in loaders)
    iterators = [iter(loader) for loader in loaders]
    digests = []
    for _ in range(len(loaders[0])):
        yielded = [next(it).tolist() for it in iterators]  # one step on every rank
        step_samples = [i for batch in yielded for i in batch]
        for rank, loader in enumerate(loaders):
            last = loader.last_global_batch()
            assert last[rank::world] == yielded[rank]
            assert sorted(last) == sorted(step_samples)
            assert samples_digest(last) == samples_digest(step_samples)
        digests.append(samples_digest(step_samples))
    assert all(list(it) == [] for it in iterators)  # the epoch ends; the step stays the last one
    assert loaders[0].epoch == 1 and samples_digest(loaders[0].last_global_batch()) == digests[-1]
    assert len(set(digests)) == len(digests)
    loaders[0].load_state_dict(loaders[1].state_dict())
    assert loaders[0].last_global_batch() == []


def test_samples_digest_is_the_documented_hash_of_the_sorted_indices():
    assert samples_digest([9, 5, 2]) == hashlib.sha256(b"2,5,9").hexdigest()[:16]
    assert samples_digest(torch.tensor([2, 9, 5])) == samples_digest([9, 5, 2])
    assert samples_digest([1, 1, 2]) != samples_digest([1, 2])  # padding repeats count
    assert len(samples_digest([])) == 16


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
        loader = ResumableDataLoader(NoisyIds(12), 3, seed=4, num_workers=2, multiprocessing_context="fork")
        return [[b for b in loader] for _ in range(2)]

    torch.manual_seed(1)
    first = two_epochs()
    torch.manual_seed(2)
    second = two_epochs()
    for epoch in range(2):
        for a, b in zip(first[epoch], second[epoch]):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(first[0][0][1], first[1][0][1])

    resumed = ResumableDataLoader(NoisyIds(12), 3, seed=4, num_workers=2, multiprocessing_context="fork")
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
    assert states[0]["global_samples_consumed"] == 2 * 16
    assert states[0]["world_size"] == 4 and states[0]["version"] == 2


def saved_state(**changes):
    loader = make_loader(num_replicas=4, rank=0)
    next(iter(loader))
    state = loader.state_dict()
    state.update(changes)
    return state


@pytest.mark.parametrize(
    ("loader_kwargs", "expected"),
    [
        (dict(length=24), "dataset_len was 23 when saved, now 24"),
        (dict(batch_size=2), "global batch size was 16 when saved, now 8"),
        (dict(shuffle=False), "shuffle was True when saved, now False"),
        (dict(drop_last=True), "drop_last was False when saved, now True"),
        (dict(seed=8), "seed was 7 when saved, now 8"),
    ],
)
def test_load_refuses_another_dataset_global_batch_or_order_setting(loader_kwargs, expected):
    loader = make_loader(num_replicas=4, rank=0, **loader_kwargs)
    with pytest.raises(StateMismatchError, match=expected):
        loader.load_state_dict(saved_state())
    assert loader.epoch == 0 and loader.batches_consumed == 0


def test_load_names_every_difference():
    loader = make_loader(num_replicas=4, rank=0, length=24, batch_size=2, shuffle=False)
    with pytest.raises(StateMismatchError) as caught:
        loader.load_state_dict(saved_state())
    for part in ("dataset_len was 23", "global batch size was 16", "shuffle was True"):
        assert part in str(caught.value)


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ({k: v for k, v in saved_state().items() if k != "epoch"}, "lacks the field 'epoch'"),
        (saved_state(epoch="1"), "'epoch'"),
        (saved_state(global_samples_consumed=True), "'global_samples_consumed'"),
        (saved_state(global_samples_consumed=-16), "'global_samples_consumed'"),
        (saved_state(global_samples_consumed=99 * 16), "not a whole number of global batches"),
        (saved_state(global_samples_consumed=20), "not a whole number of global batches"),
        (saved_state(version=3), "version 3"),
        (saved_state(extra=1), "unknown fields"),
    ],
)
def test_load_refuses_malformed_state(state, expected):
    loader = make_loader(num_replicas=4, rank=0)
    with pytest.raises(StateMismatchError, match=expected):
        loader.load_state_dict(state)
    assert loader.epoch == 0 and loader.batches_consumed == 0


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
