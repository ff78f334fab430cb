"""Bounded, strict parsing of the JSON documents a checkpoint root holds (manifests, rank
indexes, safetensors headers, incarnation records): a checkpoint is input from outside the
process, so a document must never make a reader recurse, grow or guess.

Size, nesting depth, repeated keys and NaN/Infinity are refused with a
:class:`StrictJSONError` (a ``ValueError``) and a one-line reason, which each caller turns into
its corrupt-step error. Why each: ``docs/design/internals.md`` (Checkpoint engine).
"""

from __future__ import annotations

import json
import re
from typing import Any

#: Deepest nesting of arrays and objects in any document: what serde_json (safetensors' own
#: header parser) allows by default. spotrun's documents nest at most 4 levels besides the
#: state skeleton (a state nested deeper is refused when it is saved:
#: :data:`spotrun.checkpoint.tree.MAX_SKELETON_DEPTH`); every reader of a skeleton recurses once
#: or twice per level, far inside Python's default recursion limit of 1,000.
MAX_DEPTH = 128
#: Largest manifest. A manifest grows with the tensors (~100-200 bytes each, the name
#: included; 1.3 million tensors with short names measured 140 MB) and the state skeleton;
#: 1 GiB holds several million tensors with long names, and parses in well under a minute.
MANIFEST_MAX_BYTES = 2**30
#: Largest rank index: ~60 bytes per chunk the rank wrote and 67 per MiB block of its files
#: (a 1 TiB rank file: 70 MB of block digests); 1 GiB holds a rank of millions of chunks.
INDEX_MAX_BYTES = 2**30
#: Largest incarnation or finished-run record: a few hundred bytes, plus ~20 per restart of
#: the job in the ``resumed`` table; 16 MiB is room for most of a million restarts.
RECORD_MAX_BYTES = 16 * 2**20

# Every byte but a quote, the brackets and the colon, deleted before the strings are found.
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}:')
# A string (its content by then only brackets and colons), or an unterminated one up to the
# end: each match is found in one pass and never retried, so this is linear whatever the text.
_STRING = re.compile(rb'"[^"]*"?')
_SAME_BRACKETS = bytes.maketrans(b"{}", b"[]")


class StrictJSONError(ValueError):
    """A document over a limit, nested too deeply, naming a key twice, or holding NaN."""


def _outside_strings(data: bytes) -> bytes:
    """The brackets and colons of JSON text ``data`` that lie outside its strings, in order."""
    # Escaped backslashes, then escaped quotes, left to right as json reads them: every quote
    # left delimits a string. (Outside a string a backslash is invalid JSON, refused by json
    # where it stands, past everything counted the same way up to there.)
    text = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    # Two adjacent quotes are an empty string, or the end of one and the start of the next
    # with nothing between: removing them keeps everything outside strings outside. Most
    # strings are empty by now, so few are left for the regex.
    return _STRING.sub(b"", text.replace(b'""', b""))


def _depth(brackets: bytes, stop_after: int | None) -> int:
    # an innermost pair is an opening bracket right before a closing one: removing every
    # such pair lowers the depth of the whole document by one, at C speed
    depth = 0
    text = brackets.translate(_SAME_BRACKETS)
    while text:
        shorter = text.replace(b"[]", b"")
        if len(shorter) == len(text):  # unbalanced: what is left is "]]...[[" at most
            return depth + max(text.count(b"["), 1)
        depth += 1
        text = shorter
        if stop_after is not None and depth > stop_after:
            return depth
    return depth


def nesting_depth(data: bytes, stop_after: int | None = None) -> int:
    """The deepest nesting of arrays and objects in ``data`` (JSON text), counted without
    recursion: strings removed, then brackets counted (a stray closing bracket, which json
    refuses anyway, counts as closing one level). Stops early once the depth passes
    ``stop_after``."""
    return _depth(_outside_strings(data).replace(b":", b""), stop_after)


def _key_count(doc: Any) -> int:
    """How many keys the objects of a parsed document hold (iteratively: no recursion)."""
    total = 0
    stack = [doc]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            total += len(node)
            stack.extend([v for v in node.values() if type(v) is dict or type(v) is list])
        elif type(node) is list:
            stack.extend([v for v in node if type(v) is dict or type(v) is list])
    return total


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        repeated = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise StrictJSONError(f"an object names the key {repeated[:80]!r} twice")
    return obj


def _no_constant(name: str) -> Any:
    raise StrictJSONError(f"the non-standard JSON constant {name} (spotrun never writes one)")


def loads(data: bytes | bytearray, *, max_bytes: int | None, what: str, max_depth: int = MAX_DEPTH) -> Any:
    """Parse one JSON document within the limits (see the module docstring).

    Args:
        data: the document's bytes (UTF-8).
        max_bytes: the most bytes a document of this kind may have; ``None``: no limit (the
            caller bounded what it read).
        what: the kind of document, for messages (``"manifest"``).
        max_depth: the deepest nesting allowed.

    Raises:
        StrictJSONError: a limit exceeded, a repeated key, NaN or Infinity.
        ValueError: not UTF-8 or not JSON (``UnicodeDecodeError``, ``json.JSONDecodeError``).
    """
    if max_bytes is not None and len(data) > max_bytes:
        raise StrictJSONError(f"{len(data)} bytes, more than the {max_bytes} a {what} may have")
    data = bytes(data)
    structure = _outside_strings(data)
    if _depth(structure.replace(b":", b""), max_depth) > max_depth:
        raise StrictJSONError(f"nested more than {max_depth} levels deep (the most a {what} may nest)")
    text = data.decode("utf-8")
    doc = json.loads(text, parse_constant=_no_constant)
    # In valid JSON every colon outside strings follows a key: fewer keys parsed than colons
    # means an object named a key twice (json kept the last). Counting costs a quarter of
    # what checking each object as json builds it would (a hook call per object).
    if _key_count(doc) != structure.count(b":"):
        json.loads(text, object_pairs_hook=_unique_keys)  # names the key
        raise StrictJSONError("an object names a key twice")
    return doc
