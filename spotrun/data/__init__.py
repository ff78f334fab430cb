"""Data order that resumes at the exact next batch: the sampler and loader (:mod:`.loader`), their
saved state (:mod:`.state`) and what a loader worker may hold (:mod:`.workers`).

Imports torch. May import tools, control, storage and checkpoint.
"""

from spotrun.data.loader import ResumableDataLoader, ResumableDistributedSampler, samples_digest

__all__ = ["ResumableDataLoader", "ResumableDistributedSampler", "samples_digest"]
