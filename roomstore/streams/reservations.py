"""Reserving the IDs of several streams at once: ``reserve_together``
(from generators of one database, on PostgreSQL their sequences read in one
transaction) and ``reserve_in_transaction`` (the IDs taken inside the
caller's transaction, once it knows how many it needs, and the positions
they reach written in it too).

Each generator (``id_generators.StreamIdGenerator``) keeps its own
reservations: these functions drive the same steps its ``get_next_mult``
does (begin an allocation, allocate, end it, complete the IDs), across
several generators, with one database transaction for all of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from roomstore.storage.database import Transaction
from roomstore.streams.id_generators import StreamIdGenerator, persist_positions_txn

R = TypeVar("R")


async def _allocate(wanted: Sequence[tuple[StreamIdGenerator, int]]) -> dict[int, list[int]]:
    """IDs for each request, by ``id(generator)``: one transaction for all sequences."""
    results = {id(gen): gen._allocate_locally(n) for gen, n in wanted if not gen._use_sequence}
    sequenced = [(gen, n) for gen, n in wanted if gen._use_sequence]
    if sequenced:
        names = ",".join(gen.stream_name for gen, _ in sequenced)
        from_db = await sequenced[0][0].db.run_interaction(f"allocate_stream_ids:{names}", _allocate_txn, sequenced)
        results.update((id(gen), ids) for (gen, _), ids in zip(sequenced, from_db, strict=True))
    return results


def _allocate_txn(txn: Transaction, sequenced: Sequence[tuple[StreamIdGenerator, int]]) -> list[list[int]]:
    """Every sequence's IDs in one statement (one round trip, not one each)."""
    if len(sequenced) == 1:
        gen, n = sequenced[0]
        return [gen._allocate_txn(txn, n)]
    # Sequence names are the generators' own (code), never input; counts are bound.
    sql = " UNION ALL ".join(
        f"SELECT {index}, nextval('{gen._sequence}') FROM generate_series(1, ?)"
        for index, (gen, _) in enumerate(sequenced)
    )
    ids: list[list[int]] = [[] for _ in sequenced]
    for index, stream_id in txn.execute(sql, [n for _, n in sequenced]).fetchall():
        ids[index].append(stream_id)
    return [sorted(part) for part in ids]


@contextlib.asynccontextmanager
async def reserve_together(requests: Sequence[tuple[StreamIdGenerator, int]]) -> AsyncIterator[list[list[int]]]:
    """``async with reserve_together([(gen_a, n), (gen_b, m)]) as (ids_a, ids_b)``.

    Reserves from several generators of one database at once: on PostgreSQL
    the sequences are read in one transaction, where separate ``get_next_mult``
    calls would take one each. A request for 0 IDs yields ``[]``. Every ID
    completes on exit, also when the body raises.
    """
    wanted = [(gen, n) for gen, n in requests if n]
    if len({id(gen) for gen, _ in wanted}) != len(wanted):
        raise ValueError("reserve_together: a generator is listed twice")
    databases = {id(gen.db) for gen, _ in wanted}
    if len(databases) > 1:
        raise ValueError("reserve_together needs generators of one database")
    floors: list[tuple[StreamIdGenerator, int]] = []
    try:
        for gen, n in wanted:
            floors.append((gen, gen._begin_allocation(n)))
        results = await _allocate(wanted)
    except BaseException:
        for gen, floor in floors:
            gen._end_allocation(floor, None)
        raise
    for gen, floor in floors:
        gen._end_allocation(floor, results[id(gen)])
    try:
        yield [results[id(gen)] if n else [] for gen, n in requests]
    finally:
        # Completion happens whether the body succeeded or raised.
        for gen, _n in wanted:
            gen._complete(results[id(gen)])


@contextlib.asynccontextmanager
async def reserve_in_transaction(
    generators: Sequence[StreamIdGenerator], description: str, body_txn: Callable[..., R], *args: Any
) -> AsyncIterator[tuple[R, list[list[int]]]]:
    """``async with reserve_in_transaction([gen_a, gen_b], desc, f, ...) as (result, (ids_a, ids_b))``.

    Runs ``f(txn, take, ...)`` in one transaction; ``f`` calls ``take(counts)``
    (a count, 0 or more, per generator) at most once, when it knows how many
    IDs it needs, and gets them, from PostgreSQL's sequences in that same
    transaction (in the process elsewhere): the look deciding how many, the
    IDs and their write are one interaction, not three. The positions the
    IDs reach are written in it too when nothing else of the writer's is in
    flight (``position_after``). An attempt retried on the same connection is
    given the IDs the first took. If ``f`` raises, its IDs are dropped, not
    counted complete: a sequence may hand them out again after a crash (a
    ``nextval`` whose transaction never committed is not durable). The IDs
    complete when the block ends, also if it raises.
    """
    gens = list(generators)
    if not gens or len({id(gen) for gen in gens}) != len(gens):
        raise ValueError("reserve_in_transaction: one or more generators, each once")
    if len({id(gen.db) for gen in gens}) > 1:
        raise ValueError("reserve_in_transaction needs generators of one database")
    taken: list[list[list[int]]] = []  # what ``take`` gave the transaction's last attempt
    # Every ID taken, by any attempt on one connection: a retried transaction
    # (a serialisation failure, a deadlock) is given the IDs its first took.
    held: list[list[int]] = [[] for _ in gens]
    held_on: list[object] = [None]  # the connection the IDs in ``held`` were taken on

    def attempt(txn: Transaction) -> R:
        taken.clear()

        def take(counts: Sequence[int]) -> list[list[int]]:
            if taken:
                raise RuntimeError("reserve_in_transaction: take() called twice")
            _check_counts(gens, counts)
            if held_on[0] is not txn.connection:  # lost: its server may have restarted
                held_on[0] = txn.connection
                for ids in held:
                    ids.clear()
            more = [max(0, n - len(ids)) for n, ids in zip(counts, held, strict=True)]
            for ids, fresh in zip(held, _take_txn(txn, gens, more), strict=True):
                ids.extend(fresh)  # sequences and counters only grow: still ascending
            given = [ids[:n] for ids, n in zip(held, counts, strict=True)]
            taken.append(given)
            return given

        result = body_txn(txn, take, *args)
        if taken:  # at the end, where the write's queued statements go too (asked later is as safe)
            reached = [
                (gen, pos) for gen, ids in zip(gens, taken[0], strict=True) if (pos := gen._reached_by(ids)) is not None
            ]
            if reached:
                persist_positions_txn(txn, reached)
        return result

    # Positions held from here until the IDs are known (the reservation begins with their transaction).
    floors = [(gen, gen._begin_allocation(1)) for gen in gens]
    try:
        result = await gens[0].db.run_interaction(description, attempt)
    except BaseException:
        for gen, floor in floors:
            gen._end_allocation(floor, None)
        raise
    for (gen, floor), ids in zip(floors, held, strict=True):
        gen._end_allocation(floor, ids or None)
    try:
        yield result, (taken[0] if taken else [[] for _ in gens])
    finally:
        # With the ones a retry needed fewer of: they complete unused.
        for gen, ids in zip(gens, held, strict=True):
            if ids:
                gen._complete(ids)


def _take_txn(txn: Transaction, gens: Sequence[StreamIdGenerator], counts: Sequence[int]) -> list[list[int]]:
    """(On the transaction's thread.) ``counts[i]`` IDs of ``gens[i]``: the
    sequences' in one statement, the in-process counters' under their lock."""
    if not any(counts):
        return [[] for _ in gens]
    sequenced = [(gen, n) for gen, n in zip(gens, counts, strict=True) if n and gen._use_sequence]
    from_sequences = iter(_allocate_txn(txn, sequenced) if sequenced else [])
    return [
        [] if not n else next(from_sequences) if gen._use_sequence else gen._allocate_locally(n)
        for gen, n in zip(gens, counts, strict=True)
    ]


def _check_counts(gens: Sequence[StreamIdGenerator], counts: Sequence[int]) -> None:
    if len(counts) != len(gens) or any(n < 0 for n in counts):
        raise ValueError(f"reserve_in_transaction: {tuple(counts)!r} is not one count of 0 or more per generator")
