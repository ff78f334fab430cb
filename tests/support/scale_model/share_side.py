"""Who reads which bytes from storage at the cooperative restore of a simulated job: the product's
:func:`spotrun.checkpoint.share_plan.plan_from_digests` over every restoring rank's segment
digests, as each rank runs it at a restore (``fetch.fetch_shared``).

A rank's needs fall into segments by the first component of the tensor's name and whether the
box is the whole tensor (:func:`~spotrun.checkpoint.share_plan.segments`). Within a segment, every
tensor of one *group* (same global shape and placements, or a plain tensor) has the same box on a
rank, so a segment's needs are equal on two ranks exactly when their boxes of each group are:
that tuple is the segment's signature here, computed for every rank from a few boxes instead of
thousands of needs. A segment held by two or more ranks is built once, from one of them, and
digested by the product's ``segments``; a segment held by one rank alone is read by that rank for
itself (as the product does), so it gets a stand-in digest that no other rank holds and that the
plan leaves out (``plan_from_digests`` skips groups it does not know): such needs are built only
for the ranks the model plans (:meth:`SharePlan.alone`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from spotrun.checkpoint import tree
from spotrun.checkpoint.share_plan import Need, ReadPlan, plan_from_digests, segments, writers_of

#: A segment: (first component of its names, whether its boxes are whole tensors).
SegmentKey = tuple[str, bool]
#: A tensor group's box on a rank: (offsets, lengths).
Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass
class SharePlan:
    """The cooperative plan of every restoring rank."""

    plan: ReadPlan
    """The product's plan: the groups of two or more ranks, who reads each piece."""
    keys: list[dict[SegmentKey, tuple]]
    """Per rank: its segments and their signatures."""
    holders: dict[tuple[SegmentKey, tuple], list[int]]
    """Per segment and signature: the ranks holding it."""
    planner: object
    """The :class:`~tests.support.scale_model.restore_side.RestorePlanner` that builds needs."""

    def alone(self, rank: int) -> list[Need]:
        """The needs ``rank`` reads for itself: those of the segments no other rank holds."""
        found = []
        for key, signature in self.keys[rank].items():
            if len(self.holders[(key, signature)]) == 1:
                found.extend(n for n in self.planner.segment_needs(key, rank) if n.nbytes)
        return found

    def reads(self, rank: int) -> list[Need]:
        """Everything ``rank`` reads from storage (the product's ``ReadPlan.reads`` plus its alone needs)."""
        return self.alone(rank) + self.plan.reads(rank)

    def readers_wrote_what_they_read(self, manifest) -> bool:
        """Whether each piece a group shares is read by a rank that wrote it."""
        return all(r in writers_of(n, manifest) for g in self.plan.groups for n, r in zip(g.needs, g.readers))


def segment_signatures(planner, rank: int) -> dict[SegmentKey, tuple]:
    """``rank``'s segments and their signatures (see the module docstring)."""
    found: dict[SegmentKey, list] = defaultdict(list)
    for component, group, shape in planner.tensor_groups:
        box = planner.group_box(group, rank)
        found[(component, box is None or list(box[1]) == list(shape))].append((group, box))
    source = rank % planner.manifest.world_size  # the saved rank whose own state it takes
    found[(f"rank-{source:05d}", True)].append(("own", source))
    return {key: tuple(signature) for key, signature in found.items()}


def own_names(manifest, rank: int) -> list[str]:
    """The names of the own tensors ``rank`` restores (those of saved rank ``rank mod N``)."""
    return tree.tensor_names(manifest.rank_state[rank % manifest.world_size])


def plan_sharing(planner, world_size: int) -> SharePlan:
    """The cooperative plan of ``world_size`` restoring ranks (see the module docstring)."""
    keys = [segment_signatures(planner, rank) for rank in range(world_size)]
    holders: dict[tuple[SegmentKey, tuple], list[int]] = defaultdict(list)
    for rank, mine in enumerate(keys):
        for key, signature in mine.items():
            holders[(key, signature)].append(rank)
    known: dict[str, tuple[Need, ...]] = {}
    digest_of: dict[tuple[SegmentKey, tuple], str] = {}
    for (key, signature), ranks in holders.items():
        if len(ranks) > 1:
            found = segments(planner.segment_needs(key, ranks[0]), planner.manifest)
            (digest,) = found  # one segment: the needs of one key
            known[digest] = found[digest]
            digest_of[(key, signature)] = digest
    digests_by_rank = [
        [digest_of.get((key, signature), f"alone {rank} {key}") for key, signature in mine.items()]
        for rank, mine in enumerate(keys)
    ]
    plan = plan_from_digests(digests_by_rank, known, planner.manifest)
    return SharePlan(plan, keys, dict(holders), planner)
