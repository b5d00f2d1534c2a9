"""Canonical JSON (the spec's: keys sorted by code point, no insignificant
whitespace, UTF-8, shortest escapes) on the fastest correct path.

``canonicaljson`` is the reference: its bytes are what signatures and hashes
are over. orjson writes the same bytes for every value without floats and
with integers inside 64 bits (held byte for byte by
``tests/events/test_canonical.py``), at about half the cost; it writes some
floats differently (``1e16`` where canonicaljson writes ``1e+16``), so a value
that may hold a float goes to canonicaljson, as does anything orjson refuses
(an integer beyond 64 bits, a non-string key, a type of its own).
"""

from __future__ import annotations

import os
from typing import Any

import orjson
from canonicaljson import encode_canonical_json

__all__ = ["canonical_json"]

_SORTED = orjson.OPT_SORT_KEYS
#: Set by ``bin/test``: every fast encoding is checked against canonicaljson's,
#: so each event the test suite makes holds the two byte-equal.
_CROSS_CHECK = os.environ.get("ROOMSTORE_CANONICAL_CROSS_CHECK") == "1"


class CanonicalMismatch(AssertionError):
    """(Only with the cross-check on.) orjson and canonicaljson wrote different bytes."""


def canonical_json(value: Any, *, floats: bool = True) -> bytes:
    """The canonical JSON of ``value``, byte-equal to ``encode_canonical_json``.

    ``floats=False``: the caller knows ``value`` holds no float (a parsed PDU
    whose parser saw none), so the fast encoder may write it.
    """
    if not floats:
        try:
            fast = orjson.dumps(value, option=_SORTED)
        except TypeError:  # orjson.JSONEncodeError is a TypeError
            pass
        else:
            if _CROSS_CHECK and fast != encode_canonical_json(value):
                raise CanonicalMismatch(f"orjson wrote {fast!r}, canonicaljson {encode_canonical_json(value)!r}")
            return fast
    return encode_canonical_json(value)
