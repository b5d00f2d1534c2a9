"""A validation worker process: ``python -m roomstore.events.write.validation_worker``.

``events/write/pipeline.py`` starts these (``reactor.spawnProcess``) and speaks to
each over its stdin and stdout in frames: an 8-byte big-endian length, then a
pickle. A request is ``prepare_events``'s arguments; the reply is ``(True,
prepared events)`` or ``(False, error)``, the error as ``shipped_error``
makes it (its type, arguments and attributes, whatever its ``__init__``
takes). Requests are answered one at a time, in order. Before the first, a
started worker sends ``READY`` once its imports are done, so that its
parent's ``start`` returns a worker that answers at once. The worker leaves at
the end of its stdin, which its parent's exit or death closes.

Only the parent is trusted to write to the pipe: it sends the events it was
given to persist, which are bytes, never code.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from typing import Any, BinaryIO

from roomstore.processes import BULK_GC_THRESHOLDS, leave_now, tune_collector

HEADER = struct.Struct("!Q")
#: The first frame a worker sends, once it can validate.
READY = ("ready",)


def frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


class FrameReader:
    """Splits a byte stream into its frames' objects, for a Twisted
    protocol's ``dataReceived`` (the writer process and its parent)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list:
        """The objects of the frames ``data`` completes, in order."""
        buffer = self._buffer
        buffer += data
        objects, start = [], 0
        while len(buffer) - start >= HEADER.size:
            (length,) = HEADER.unpack_from(buffer, start)
            end = start + HEADER.size + length
            if len(buffer) < end:
                break
            objects.append(pickle.loads(memoryview(buffer)[start + HEADER.size : end]))
            start = end
        del buffer[:start]
        return objects


def shipped_error(error: BaseException) -> tuple:
    """A picklable description of ``error`` (``rebuilt_error`` reverses it)."""
    state = {k: v for k, v in vars(error).items() if _picklable(v)}
    if _picklable(error.args) and _picklable(type(error)):
        return (type(error), error.args, state)
    return (RuntimeError, (f"{type(error).__name__}: {error}",), {})


def rebuilt_error(shipped: tuple) -> BaseException:
    cls, args, state = shipped
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return False
    return True


def _read_exact(stream: BinaryIO, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def serve(requests: BinaryIO, replies: BinaryIO) -> None:
    """Answer requests until ``requests`` ends."""
    from roomstore.events.write.batch import prepare_events

    replies.write(frame(READY))
    replies.flush()
    while True:
        header = _read_exact(requests, HEADER.size)
        if header is None:
            return
        body = _read_exact(requests, HEADER.unpack(header)[0])
        if body is None:
            return
        reply: tuple[bool, Any]
        try:
            reply = (True, prepare_events(*pickle.loads(body)))
        except Exception as error:  # noqa: BLE001 - every error goes back to the caller
            reply = (False, shipped_error(error))
        replies.write(frame(reply))
        replies.flush()


def claim_stdout() -> int:
    """A descriptor of its own for a worker's frames, which stdout was; stdout
    becomes stderr, so anything else printing to it (a warning, a library)
    cannot break a frame."""
    replies_fd = os.dup(1)
    os.dup2(2, 1)
    return replies_fd


def main() -> None:
    # A batch's objects all live until its reply is written and die with it:
    # with Python's thresholds a young collection would walk the batch being
    # built thousands of times an import, to find nothing (9% of a worker's
    # CPU, docs/benchmarks.md).
    tune_collector(BULK_GC_THRESHOLDS)
    try:
        serve(sys.stdin.buffer, os.fdopen(claim_stdout(), "wb"))
    except BrokenPipeError:
        # The process that asked is gone (killed mid-batch): nobody is left to
        # answer, nor to read a traceback. Leave at once, without the exit's
        # flush of the replies, which would only fail again.
        leave_now(0)


if __name__ == "__main__":
    main()
