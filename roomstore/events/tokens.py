"""Opaque room stream tokens, as handed to clients for sync and pagination.

Three textual forms (the same shapes Synapse uses for ``RoomStreamToken``):

* ``s<stream>``: a live position; every event with stream ordering
  <= ``stream`` is included.
* ``m<stream>~<instance>.<pos>~<instance>.<pos>...``: the multi-writer form.
  ``stream`` is the minimum position all writers have reached; each
  ``<instance>.<pos>`` entry names a writer (by its small integer instance
  ID) that is strictly ahead of it.  Writers not listed are at ``stream``.
* ``t<topological>-<stream>``: a position in topological (DAG depth) order,
  used for pagination; ``stream`` breaks ties between events of equal depth.

Parsing is strict so that every accepted string has exactly one spelling:
``parse(s).to_string() == s`` for every ``s`` that parses.  That rules out
leading zeros, signs other than a leading ``-`` on a topological token's
stream part, whitespace, an ``m`` token without entries (spelled ``s``),
unsorted or repeated instance IDs, and entries not ahead of the minimum.
Positions and instance IDs must fit a signed 64-bit column.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import attrs

__all__ = [
    "InvalidToken",
    "MAX_POSITION",
    "RoomToken",
    "StreamToken",
    "TopologicalToken",
    "parse_token",
]

#: Largest position or instance ID a token may carry (PostgreSQL BIGINT).
MAX_POSITION = 2**63 - 1

# At most 19 digits, no leading zeros; the range is checked after int().
_UNSIGNED = r"(?:0|[1-9][0-9]{0,18})"
_SIGNED = r"(?:0|-?[1-9][0-9]{0,18})"
_S_TOKEN = re.compile(rf"s({_UNSIGNED})", re.ASCII)
_T_TOKEN = re.compile(rf"t({_UNSIGNED})-({_SIGNED})", re.ASCII)
_M_HEAD = re.compile(rf"m({_UNSIGNED})", re.ASCII)
_M_ENTRY = re.compile(rf"({_UNSIGNED})\.({_UNSIGNED})", re.ASCII)


class InvalidToken(ValueError):
    """A token string is malformed, or token fields are out of range."""


def _to_int(digits: str, token: str) -> int:
    value = int(digits)
    if not -MAX_POSITION <= value <= MAX_POSITION:
        raise InvalidToken(f"token {token!r}: {digits} does not fit in 64 bits")
    return value


def _check_position(name: str, value: object, *, allow_negative: bool = False) -> None:
    # bool is an int subclass; a True position is always a bug.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidToken(f"{name} must be an int, got {type(value).__name__}")
    low = -MAX_POSITION if allow_negative else 0
    if not low <= value <= MAX_POSITION:
        raise InvalidToken(f"{name} {value} is outside [{low}, {MAX_POSITION}]")


def _validate_stream(instance: StreamToken, attribute: object, value: int) -> None:
    _check_position("stream", value)


def _validate_positions(instance: StreamToken, attribute: object, value: tuple[tuple[int, int], ...]) -> None:
    if not isinstance(value, tuple):
        raise InvalidToken("instance_positions must be a tuple of (instance_id, pos)")
    previous = -1
    for entry in value:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise InvalidToken(f"instance position {entry!r} is not (instance_id, pos)")
        instance_id, pos = entry
        _check_position("instance id", instance_id)
        _check_position("position", pos)
        if instance_id <= previous:
            raise InvalidToken(
                "instance_positions must be sorted by instance id without repeats; "
                "use StreamToken.create() to normalise"
            )
        if pos <= instance.stream:
            raise InvalidToken(
                f"instance {instance_id} is at {pos}, not ahead of the minimum "
                f"{instance.stream}; use StreamToken.create() to normalise"
            )
        previous = instance_id


# order=False: tokens are partially ordered; use is_before_or_eq, not "<".
@attrs.frozen(order=False)
class StreamToken:
    """A live stream position, optionally with per-writer positions.

    Invariant (enforced on construction): ``instance_positions`` is sorted by
    instance ID, IDs are unique, and every position is strictly greater than
    ``stream``.  Build from arbitrary per-writer positions with
    :meth:`create`, which normalises.  Equal tokens have equal strings.
    """

    #: Minimum position: every writer has persisted everything up to here.
    stream: int = attrs.field(validator=_validate_stream)
    #: ``(instance_id, position)`` for writers ahead of ``stream``.
    instance_positions: tuple[tuple[int, int], ...] = attrs.field(default=(), validator=_validate_positions)

    @classmethod
    def create(
        cls,
        stream: int,
        positions: Mapping[int, int] | Iterable[tuple[int, int]] = (),
    ) -> StreamToken:
        """Build a token, dropping writers not ahead of ``stream`` and sorting.

        Raises:
            InvalidToken: a value is out of range, or an instance ID repeats.
        """
        _check_position("stream", stream)
        pairs = positions.items() if isinstance(positions, Mapping) else positions
        seen: dict[int, int] = {}
        for instance_id, pos in pairs:
            _check_position("instance id", instance_id)
            _check_position("position", pos)
            if instance_id in seen:
                raise InvalidToken(f"instance id {instance_id} given twice")
            seen[instance_id] = pos
        ahead = tuple(sorted((i, p) for i, p in seen.items() if p > stream))
        return cls(stream, ahead)

    @classmethod
    def parse(cls, token: str) -> StreamToken:
        """Parse an ``s...`` or ``m...`` token.

        Raises:
            InvalidToken: ``token`` is not a canonically spelled stream token.
        """
        if not isinstance(token, str):
            raise InvalidToken(f"token must be a string, not {type(token).__name__}")
        match = _S_TOKEN.fullmatch(token)
        if match:
            return cls(_to_int(match.group(1), token))
        if not token.startswith("m"):
            raise InvalidToken(f"{token!r} is not a stream token ('s<n>' or 'm<n>~...')")
        head, *entries = token.split("~")
        head_match = _M_HEAD.fullmatch(head)
        if not head_match:
            raise InvalidToken(f"{token!r}: bad minimum position {head[1:]!r}")
        if not entries:
            raise InvalidToken(
                f"{token!r}: a multi-writer token needs at least one "
                "'<instance>.<pos>' entry (without any it is spelled 's<n>')"
            )
        positions = []
        for entry in entries:
            entry_match = _M_ENTRY.fullmatch(entry)
            if not entry_match:
                raise InvalidToken(f"{token!r}: bad writer entry {entry!r}")
            positions.append((_to_int(entry_match.group(1), token), _to_int(entry_match.group(2), token)))
        try:
            return cls(_to_int(head_match.group(1), token), tuple(positions))
        except InvalidToken as e:
            raise InvalidToken(f"{token!r}: {e}") from None

    def to_string(self) -> str:
        """Render the token; the inverse of :meth:`parse`."""
        if not self.instance_positions:
            return f"s{self.stream}"
        entries = "~".join(f"{i}.{p}" for i, p in self.instance_positions)
        return f"m{self.stream}~{entries}"

    def get_stream_pos_for_instance(self, instance_id: int) -> int:
        """Position reached by writer ``instance_id`` (``stream`` if unlisted)."""
        for listed, pos in self.instance_positions:
            if listed == instance_id:
                return pos
        return self.stream

    def get_max_stream_pos(self) -> int:
        """The furthest position any writer has reached."""
        return max((p for _, p in self.instance_positions), default=self.stream)

    def is_before_or_eq(self, other: StreamToken) -> bool:
        """True if every writer's position here is <= its position in ``other``.

        This is a partial order: two tokens may each be ahead on some writer,
        in which case both ``a.is_before_or_eq(b)`` and the converse are False.
        """
        if not isinstance(other, StreamToken):
            raise TypeError(f"cannot compare StreamToken with {type(other).__name__}")
        if self.stream > other.stream:
            return False
        # Writers unlisted here sit at self.stream <= other.stream <= theirs.
        return all(pos <= other.get_stream_pos_for_instance(i) for i, pos in self.instance_positions)

    def copy_and_advance(self, other: StreamToken) -> StreamToken:
        """Return the pointwise maximum of ``self`` and ``other``."""
        if not isinstance(other, StreamToken):
            raise TypeError(f"cannot combine StreamToken with {type(other).__name__}")
        instances = {i for i, _ in self.instance_positions} | {i for i, _ in other.instance_positions}
        merged = {i: max(self.get_stream_pos_for_instance(i), other.get_stream_pos_for_instance(i)) for i in instances}
        return StreamToken.create(max(self.stream, other.stream), merged)


def _validate_topological(instance: TopologicalToken, attribute: object, value: int) -> None:
    _check_position("topological", value)


def _validate_topo_stream(instance: TopologicalToken, attribute: object, value: int) -> None:
    # Backfilled events get negative stream orderings, so allow them here.
    _check_position("stream", value, allow_negative=True)


@attrs.frozen(order=False)
class TopologicalToken:
    """A pagination position: ``(topological, stream)``, ordered lexicographically.

    ``topological`` is an event depth (>= 0).  ``stream`` may be negative:
    backfilled events are given negative stream orderings.
    """

    topological: int = attrs.field(validator=_validate_topological)
    stream: int = attrs.field(validator=_validate_topo_stream)

    @classmethod
    def parse(cls, token: str) -> TopologicalToken:
        """Parse a ``t<topological>-<stream>`` token.

        Raises:
            InvalidToken: ``token`` is not a canonically spelled topological token.
        """
        if not isinstance(token, str):
            raise InvalidToken(f"token must be a string, not {type(token).__name__}")
        match = _T_TOKEN.fullmatch(token)
        if not match:
            raise InvalidToken(f"{token!r} is not a topological token ('t<n>-<n>')")
        return cls(_to_int(match.group(1), token), _to_int(match.group(2), token))

    def to_string(self) -> str:
        """Render the token; the inverse of :meth:`parse`."""
        return f"t{self.topological}-{self.stream}"

    def as_tuple(self) -> tuple[int, int]:
        """``(topological, stream)``, the sort key."""
        return (self.topological, self.stream)

    def is_before_or_eq(self, other: TopologicalToken) -> bool:
        """True if ``self`` sorts at or before ``other`` (a total order)."""
        if not isinstance(other, TopologicalToken):
            raise TypeError(f"cannot compare TopologicalToken with {type(other).__name__}")
        return self.as_tuple() <= other.as_tuple()


RoomToken = StreamToken | TopologicalToken


def parse_token(token: str) -> RoomToken:
    """Parse any of the three forms, dispatching on the first character.

    Raises:
        InvalidToken: the string is not a valid token of any form.
    """
    if isinstance(token, str) and token.startswith("t"):
        return TopologicalToken.parse(token)
    if isinstance(token, str) and token[:1] in ("s", "m"):
        return StreamToken.parse(token)
    raise InvalidToken(f"{token!r} is not a room token (expected 's', 'm' or 't' prefix)")
