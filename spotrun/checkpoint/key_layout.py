"""The key layout a manifest records (format 5): where a step's data files lie when its ranks'
files are spread over key prefixes (:mod:`spotrun.checkpoint.layout` makes the keys from it).
The layout and why: ``docs/design/storage.md`` (Keys that spread over prefixes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spotrun.checkpoint.chunks import brief

#: The format of a step whose ranks' files lie under spread key prefixes (``key_layout``).
SPREAD_LAYOUT_FORMAT_VERSION = 5
#: Most digits of the rank a spread prefix is made of (ranks are written with 5).
MAX_SPREAD_DIGITS = 5


@dataclass(frozen=True)
class SpreadLayout:
    """Format 5: each rank's data files and index lie under a key prefix made of the last
    ``digits`` decimal digits of the writer's rank, reversed (:func:`spotrun.checkpoint.layout.spread_dir`),
    instead of in the step directory. Written ``{"kind": "spread", "digits": 2}``.

    Attributes:
        digits: 1 to :data:`MAX_SPREAD_DIGITS`; ``10 ** digits`` prefixes at most.
    """

    digits: int

    def to_json(self) -> dict[str, Any]:
        return {"kind": "spread", "digits": self.digits}


def parse_key_layout(doc: dict[str, Any]) -> SpreadLayout | None:
    """``key_layout``: required in format 5, absent before. It names where the step's files lie,
    so nothing but its one known form is accepted (the keys are built from it and the ranks)."""
    raw = doc.get("key_layout")
    if doc["format_version"] < SPREAD_LAYOUT_FORMAT_VERSION:
        if "key_layout" in doc:
            raise ValueError(
                f"key_layout is a field of format {SPREAD_LAYOUT_FORMAT_VERSION}, not {doc['format_version']}"
            )
        return None
    if (
        type(raw) is not dict
        or set(raw) != {"kind", "digits"}
        or raw["kind"] != "spread"
        or type(raw["digits"]) is not int
        or not 1 <= raw["digits"] <= MAX_SPREAD_DIGITS
    ):
        raise ValueError(
            f'key_layout must be {{"kind": "spread", "digits": 1 to {MAX_SPREAD_DIGITS}}}, got {brief(raw)}'
        )
    return SpreadLayout(raw["digits"])
