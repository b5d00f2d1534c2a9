"""Importing a JSON-lines file (``roomstore import`` and the demo): reading
the lines, each event's bytes exactly as they stand on its line, and the
batch loop that reports what the store refuses and imports the rest."""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Iterator
from typing import Any

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python import failure

from roomstore.cli.common import emit
from roomstore.events.write.persist import EVENT_REFUSALS
from roomstore.pdu.json_decoding import quick_json
from roomstore.pdu.parsing import MAX_JSON_NESTING
from roomstore.storage import DatabaseConfigError, DatabaseUnavailableError, SchemaError, StorageFullError
from roomstore.writer_process.parent import WriterProcessLost


def read_import_lines(path: str) -> Iterator[tuple[int, bytes | None, str | None]]:
    """(line number, event bytes, room version or None) per non-blank line;
    for a line that cannot be an event (not UTF-8 JSON, truncated, nested
    too deeply to read, a wrapped line of another shape): (line number, None,
    why).

    A bare PDU line is stored byte for byte; so is the event of a wrapped line
    ``{"room_version": "...", "event": {...}}``: its bytes exactly as they
    stand on the line. A line is wrapped when it has ``room_version``, and
    then it has exactly those two members; any other object is a bare PDU
    (which may have a top-level ``event`` of its own: it is kept, not unwrapped).
    """
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line:
                continue
            wrapped = _quickly_unwrapped(line)
            if wrapped is not None:
                yield number, wrapped[1], wrapped[0]
                continue
            if _plainly_bare(line):
                yield number, line, None
                continue
            try:
                text = line.decode("utf-8")
                obj = json.loads(text)
            except (UnicodeDecodeError, ValueError) as exc:
                yield number, None, f"not a JSON object ({exc}): a truncated or damaged line?"
                continue
            except RecursionError:
                yield number, None, f"nested too deeply to read; the limit is {MAX_JSON_NESTING} levels"
                continue
            if isinstance(obj, dict) and "room_version" in obj:
                why = _wrapped_line_problem(obj)
                if why:
                    yield number, None, why
                    continue
                yield number, member_text(text, "event").encode("utf-8"), obj["room_version"]
            else:
                yield number, line, None


#: A wrapped line as ``generate-sample`` and exports write it: ``{"room_version": "...", "event": `` first.
_WS = rb"[ \t\r\n]*"
_WRAPPED_START = re.compile(
    rb"\{"
    + _WS
    + rb'"room_version"'
    + _WS
    + rb":"
    + _WS
    + rb'"([^"\\\x00-\x1f]*)"'
    + _WS
    + rb","
    + _WS
    + rb'"event"'
    + _WS
    + rb":"
    + _WS
)


def _quickly_unwrapped(line: bytes) -> tuple[str, bytes] | None:
    """(room version, event bytes) of a wrapped line that starts with its
    ``room_version`` (a string without escapes) and ``"event":``, whose rest
    but its closing brace is one JSON object: then the line is that object
    with exactly those two members, and the rest is the event's text as
    ``member_text`` finds it, read with one orjson parse instead of three.
    None for any other line, which goes the way that judges every line."""
    start = _WRAPPED_START.match(line)
    if start is None or not line.endswith(b"}"):
        return None
    event = line[start.end() : -1].rstrip(b" \t\r\n")
    if not event.startswith(b"{") or not isinstance(quick_json(event), dict):
        return None
    try:
        return start.group(1).decode("utf-8"), event
    except UnicodeDecodeError:
        return None


def _plainly_bare(line: bytes) -> bool:
    """Whether ``line`` is certainly a JSON object without ``room_version``,
    as ``json.loads`` would read it (``quick_json``: several times faster);
    the others go the slow way and are judged as before."""
    obj = quick_json(line)
    return isinstance(obj, dict) and "room_version" not in obj


def _wrapped_line_problem(obj: dict) -> str | None:
    """Why a line with ``room_version`` is not ``{"room_version": "...",
    "event": {...}}``, or None when it is."""
    if not isinstance(obj["room_version"], str):
        return "room_version must be a string"
    if not isinstance(obj.get("event"), dict):
        return 'a line with room_version must have the event as an object: {"room_version": "...", "event": {...}}'
    extra = sorted(set(obj) - {"room_version", "event"})
    if extra:
        return f"a line with room_version has only room_version and event, not {', '.join(map(repr, extra))}"
    return None


_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


def member_text(text: str, wanted: str) -> str:
    """The text of member ``wanted``'s value in the JSON object ``text``, as
    written (the last one, as ``json.loads`` keeps the last of repeated keys).

    ``text`` is known to parse as an object with that member.
    """
    found = None
    pos = text.index("{") + 1
    while True:
        while text[pos] in _WHITESPACE:
            pos += 1
        if text[pos] == "}":
            break
        key, pos = json.decoder.scanstring(text, pos + 1)  # type: ignore[attr-defined]  # CPython private
        while text[pos] in _WHITESPACE + ":":
            pos += 1
        _, end = _DECODER.raw_decode(text, pos)
        if key == wanted:
            found = text[pos:end]
        pos = end
        while text[pos] in _WHITESPACE:
            pos += 1
        if text[pos] == ",":
            pos += 1
        else:
            break
    assert found is not None, wanted
    return found


def count_lines(path: str) -> int:
    """The file's non-blank lines: the progress bar's total (read only for a bar that is shown)."""
    with open(path, "rb") as handle:
        return sum(1 for line in handle if not line.isspace())


_log = Logger()

#: A refused batch is persisted again in halves down to this many events,
#: then event by event (``_ImportRun.in_halves``).
ONE_BY_ONE_FROM = 16

#: What stops an import whole: the database, the disk or the process, never
#: one event (every other error is the failure of the events that met it).
STOPS_IMPORT = (
    DatabaseConfigError,
    DatabaseUnavailableError,
    StorageFullError,
    SchemaError,
    WriterProcessLost,
    OSError,
    MemoryError,
    defer.CancelledError,
)


async def import_file(
    store,
    path: str,
    batch_size: int = 100,
    progress: bool = False,
    strict: bool = False,
    verify_keys=None,
    summary: dict | None = None,
    in_flight: int = 1,
    trust_source: bool = False,
) -> dict:
    """Import a JSON-lines file in batches; a failing batch is retried in
    halves, then event by event, so one unresolvable event is reported and
    the rest imported.

    An event whose content hash does not match is stored redacted and reported
    (one line, ``"error": "content hash mismatch"``); ``strict`` refuses it
    instead. ``verify_keys`` (``roomstore.pdu.signatures``): signatures are
    checked where the keys allow, a bad one refuses the event.
    A progress bar on stderr when it is a terminal, or ``progress`` forces it.
    ``summary`` (filled as it goes) keeps the counts when an error stops it:
    ``next_line`` is the first line not imported. After a full disk nothing
    after it is stored (the store refuses the batches queued behind the one
    that ran out); after another stop (the database gone, the writer process
    lost) batches in flight after it may be stored too. An import run again
    skips what is stored.

    ``in_flight``: batches handed to ``persist_events`` before the first is
    awaited, so the store validates the next ones while it writes, and
    commits several in one transaction (group commit). Results are taken in
    file order. A refused batch is retried (in halves, then event by event)
    once the batches before it are settled; a later batch that needed its
    events was refused too and is retried the same way after it. A later
    batch that did not need them may have been written before that retry:
    its events then come first in the stream, and where a later batch
    changed what a retried event's state is checked against (a room's
    forward extremities), that event's outcome can differ from
    ``in_flight=1``, which keeps file order strictly. Nothing is lost either way: each refused event is reported.

    The store checks each event against its room's authorization rules and
    stores one that breaks them rejected: counted (``rejected``) and
    reported, one line each. ``trust_source``: the file comes from a server
    that checked its events already; they are stored as given, unchecked."""
    from roomstore.events.write.persist import EventToPersist
    from roomstore.progress import bar_shown, progress_bar

    if in_flight < 1:
        raise ValueError(f"in_flight must be 1 or more, not {in_flight}")
    run = _ImportRun(store, {"refuse_hash_mismatch": strict, "verify_keys": verify_keys}, summary)
    # The lines are read as the batches are made, not all first: the first
    # batch is written while the rest of the file is still unread, and an
    # import holds a few batches' lines in memory, not the whole file's.
    run.bar = progress_bar(count_lines(path) if bar_shown(progress) else None, "import", "event", force=progress)
    pending: deque = deque()
    try:
        for chunk in run.batches(path, batch_size):
            batch = [EventToPersist(raw, version, auth_checked=trust_source) for _, raw, version in chunk]
            pending.append((chunk, batch, defer.ensureDeferred(store.persist_events(batch, **run.options))))
            if len(pending) >= in_flight:
                await run.settle(*pending.popleft())
        while pending:
            await run.settle(*pending.popleft())
        run.report_bad_lines()
    finally:
        # An error stops the import: the batches still in flight end before
        # it is raised (the caller closes the store next); theirs are dropped.
        for _, _, written in pending:
            try:
                await written
            except Exception:  # noqa: BLE001 - the first error is the one raised
                pass
    run.bar.close()
    return run.finished(verify_keys is not None)


class _ImportRun:
    """One ``import_file``'s counts and reports: each settled batch's
    results counted and its refusals reported, a line of output each."""

    def __init__(self, store, options: dict, summary: dict | None):
        self.store = store
        #: ``persist_events``' keyword arguments.
        self.options = options
        self.summary = {} if summary is None else summary
        self.summary.update(imported=0, already_present=0, failed=0, rejected=0, redacted_content_hash_mismatch=0)
        self.bar: Any = None
        #: Results whose signatures were not all checked (no key known).
        self.unchecked = 0
        #: ``(line number, why)`` of the bad lines read and not yet reported.
        self.bad_lines: deque = deque()

    def batches(self, path: str, size: int) -> Iterator[list[tuple[int, bytes, str | None]]]:
        """The file's event lines, ``(number, raw, version)``, in batches of
        ``size``, read as they are asked for. A bad line is held, to be
        reported in line order among the events' reports (``report_bad_lines``)."""
        chunk: list[tuple[int, bytes, str | None]] = []
        for number, raw, version in read_import_lines(path):
            if raw is None:
                self.bad_lines.append((number, version))
                continue
            chunk.append((number, raw, version))
            if len(chunk) == size:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    def report_bad_lines(self, before: int | None = None) -> None:
        """The bad lines read so far (all, or those before line ``before``), reported and counted."""
        bad = self.bad_lines
        while bad and (before is None or bad[0][0] < before):
            number, why = bad.popleft()
            self.summary["failed"] += 1
            emit({"line": number, "error": "BadLine", "message": why})
            self.bar.update(1)

    def refused(self, line: int, exc: Exception) -> None:
        self.summary["failed"] += 1
        if not isinstance(exc, EVENT_REFUSALS):  # a defect of ours, not of the event: -v logs where
            _log.failure("line {line}: unexpected error", failure.Failure(exc), line=line)
        emit({"line": line, "error": type(exc).__name__, "message": " ".join(str(exc).split()) or "no message"})

    async def in_halves(self, chunk, batch, batch_error: Exception) -> list:
        """A refused batch persisted again in halves, each half that is
        refused in halves again, down to ``ONE_BY_ONE_FROM`` events, which
        go one by one: the events the store refuses are reported and the
        rest imported as event by event, in order, but one refusal in a
        batch of N costs about 2·log2(N) more calls, not N. A batch refused
        for a cycle among its prev events goes one by one at once, so the
        cycle's events are reported with its error."""
        from roomstore.events.write.batch import PrevEventsCycle

        if len(batch) <= ONE_BY_ONE_FROM or isinstance(batch_error, PrevEventsCycle):
            return await self.one_by_one(chunk, batch, batch_error)
        middle = len(batch) // 2
        results: list[Any] = []
        for part_chunk, part in ((chunk[:middle], batch[:middle]), (chunk[middle:], batch[middle:])):
            try:
                results.extend(zip(part_chunk, await self.store.persist_events(part, **self.options), strict=True))
            except STOPS_IMPORT:
                raise
            except Exception as exc:  # noqa: BLE001 - found in smaller parts
                results.extend(await self.in_halves(part_chunk, part, exc))
        return results

    async def one_by_one(self, chunk, batch, batch_error: Exception) -> list:
        """Each event of a refused batch alone; a cycle's events are refused
        with the batch's error (alone, each would only miss its prevs)."""
        from roomstore.events.write.batch import PrevEventsCycle, peek_event_id

        cycle = batch_error.event_ids if isinstance(batch_error, PrevEventsCycle) else ()
        results: list[Any] = []
        for line, item in zip(chunk, batch, strict=True):
            if cycle and peek_event_id(item.raw) in cycle:
                self.refused(line[0], batch_error)
                continue
            try:
                results.extend((line, r) for r in await self.store.persist_events([item], **self.options))
            except STOPS_IMPORT:
                raise
            except Exception as exc:  # noqa: BLE001 - any other error is this event's alone
                self.refused(line[0], exc)
        return results

    async def settle(self, chunk, batch, written: defer.Deferred) -> None:
        """A batch's results awaited (a refused batch retried in halves, then event by event), counted and reported."""
        self.summary["next_line"] = chunk[0][0]
        self.report_bad_lines(before=chunk[0][0])
        try:
            results = list(zip(chunk, await written, strict=True))
        except STOPS_IMPORT:
            raise
        except Exception as exc:  # noqa: BLE001 - found in halves, then event by event
            results = await self.in_halves(chunk, batch, exc)
        for (number, _, _), result in results:
            self.count(number, result)
        self.bar.update(len(chunk))

    def count(self, number: int, result) -> None:
        """One event's result counted; a content hash mismatch or a rejection reported."""
        summary = self.summary
        summary["already_present" if result.already_persisted else "imported"] += 1
        if result.content_hash_mismatch:
            if not result.already_persisted:
                summary["redacted_content_hash_mismatch"] += 1
            emit(
                {
                    "line": number,
                    "event_id": result.event_id,
                    "error": "content hash mismatch",
                    "stored": "an earlier copy" if result.already_persisted else "redacted",
                }
            )
        self.unchecked += not result.signatures_checked
        if result.rejected_reason is not None:
            summary["rejected"] += 1
            emit({"line": number, "event_id": result.event_id, "rejected": result.rejected_reason})

    def finished(self, keys_given: bool) -> dict:
        """The summary, with what was known of the signatures."""
        summary = self.summary
        summary.pop("next_line", None)
        if not keys_given:
            summary["signatures"] = "not checked: no --keys file given"
        else:
            summary["signatures"] = {
                "checked": summary["imported"] + summary["already_present"] - self.unchecked,
                "unchecked_no_key": self.unchecked,
            }
        return summary
