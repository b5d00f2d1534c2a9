"""The shape of roomstore/, read from its source (issue 9).

The import graph is read with ``ast``, never by importing: every ``import``
and ``from ... import`` statement anywhere in a module counts (at the top,
inside functions, under ``if TYPE_CHECKING:``, in ``try`` blocks), relative
or absolute. An edge goes to the most specific module of the package that the
statement names: ``from roomstore.storage import engines`` is an edge to
``roomstore.storage.engines``, ``from roomstore.storage.engines import Engine``
too, ``from roomstore.storage import Database`` an edge to the package
``roomstore.storage`` (its ``__init__``). The parent packages Python runs on
the way are not edges: a package re-exporting its modules is no cycle.

Checked on the real tree:

- no import cycle between modules (each cycle is reported as a path);
- the store (``events``, ``state``, ``visibility``, ``storage``, ``streams``
  and ``roomstore/store.py``) never imports ``replication``, ``compaction``,
  ``synapse_db`` (the Synapse database reader) or ``homeserver``;
- the homeserver imports only the store's public face and ``roomstore.pdu``,
  and nothing but the command line imports it;
- ``storage`` imports nothing else of roomstore, and ``streams``, ``state``
  and ``visibility`` import only ``storage``;
- no module over 700 lines;
- every table the schema creates (full schema and deltas) has its owner in
  the table of ``docs/architecture.md``;
- each table's SQL is in its owner only: no other module names the table in
  a SQL string (after ``FROM``, ``JOIN``, ``INTO``, ``UPDATE``, ``TABLE`` or
  ``TRUNCATE``) or hands its name to ``insert_many``/``Interner``; the two
  modules that query a *Synapse* database, whose tables share names with
  ours, are the exception, and a table may have one declared second home
  (:data:`SECOND_HOMES`, named in its row of the owner table too);
- one list of the schema's tables (``SCHEMA_TABLES``), equal to what the schema files create;
- ``schema_version`` and ``applied_schema_deltas`` are named in SQL only by ``storage/schema.py``;
- no module puts a table's name into SQL as a value (f-string, concatenation) but the owners and the modules of
  :data:`TABLE_NAMES_BY_VALUE`;
- a table's columns are named in SQL only in its owner (a column only that table has; :data:`COLUMNS_PENDING`:
  what is not yet moved, shrinking only). A statement joining several tables (a composed read) lives in the owner
  of the table it is about, which reads there the columns of the tables it joins through their owners' fragments,
  each declared with its reason (:data:`COMPOSED_READS`, checked: no declaration unused, each by an owner); the
  read modules keep only parameters and row handling. SQL over a relation its caller names (:data:`RELATION_SQL`:
  the compaction planner's, either layout's) names no table and counts toward none;
- an owner is a module, or a package (``roomstore/events/tables/events/``: one module per concern) whose every
  module owns the table;
- no function over 80 lines (:data:`LONG_FUNCTIONS_PENDING`: not yet split, shrinking only);
- no module defines the same top-level function or class twice (a merge of
  two branches that each added a helper of one name silently keeps the
  second);
- the pure PDU package (``roomstore.pdu``: parsing, hashing, signatures, the
  redaction algorithm, room versions, the auth rules) imports nothing else of
  roomstore;
- the pure state resolution package (``roomstore.resolution``) imports only
  ``roomstore.pdu``.

The checker itself is tested on small packages written to a temp directory.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterable
from itertools import pairwise
from pathlib import Path

from twisted.trial import unittest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "roomstore"
MAX_LINES = 700
#: The store: what a homeserver embeds. It must not know its users.
STORE = (
    "roomstore.events",
    "roomstore.state",
    "roomstore.visibility",
    "roomstore.storage",
    "roomstore.streams",
    "roomstore.store",
    "roomstore.writer_process",
)
#: What sits above the store.
ABOVE_STORE = ("roomstore.replication", "roomstore.compaction", "roomstore.synapse_db", "roomstore.homeserver")
#: The homeserver (issue 41) is an embedder like any other: of roomstore it may import only the store's public
#: face (``RoomStore``, ``StoreConfig``, ``EventToPersist`` from ``roomstore.store``; the ``roomstore.events`` and
#: ``roomstore.storage`` packages' exported names; embedder schemas) and the pure ``roomstore.pdu``.
HOMESERVER = "roomstore.homeserver"
HOMESERVER_MAY_IMPORT = (
    "roomstore.homeserver",
    "roomstore.store",
    "roomstore.pdu",
    "roomstore.storage.embedder_schema",
)
HOMESERVER_MAY_IMPORT_PACKAGES = ("roomstore.events", "roomstore.storage")
#: The Synapse database reader imports what an embedder does (``roomstore``'s exports), its own modules, and
#: storage's URL helpers and errors (it opens a Synapse database as the store opens its own).
SYNAPSE_DB = "roomstore.synapse_db"
SYNAPSE_DB_MAY_IMPORT = ("roomstore.synapse_db", "roomstore.storage.db_urls", "roomstore.storage.errors")
#: Schema directories whose tables need an owner: the store's, and the homeserver's embedder schema.
SCHEMA_DIRS = ("schema", "homeserver/schema")
#: Modules whose SQL runs against a Synapse database: its tables (events, state_groups, ...) are not ours.
SYNAPSE_SQL = ("roomstore/synapse_db/source.py", "roomstore/compaction/synapse_sql.py")
#: Calls whose first string argument is a table name.
TABLE_CALLS = ("insert_many", "Interner")
#: Tables whose SQL has a second home besides their owner, by table. The state tables' owner
#: (roomstore/state/group_tables.py) holds the store's statements; the offline compaction job's own SQL on
#: them (its planning and JDBC reads, the swap's lock, re-check and rewrites), which the store never runs,
#: lives with the job's roomstore layout instead (issue 43). Declared here and in the tables' rows of
#: docs/architecture.md (checked), so a third module naming them still fails.
SECOND_HOMES = {
    "state_groups": "roomstore/compaction/roomstore_sql.py",
    "state_group_deltas": "roomstore/compaction/roomstore_sql.py",
}
#: The migrations' bookkeeping tables, created in code rather than in a schema file: ``schema_version`` is read and
#: written in one module (``READ_SCHEMA_VERSION``, which the compaction job runs too).
BOOKKEEPING_OWNERS = {
    "schema_version": "roomstore/storage/schema.py",
    "applied_schema_deltas": "roomstore/storage/schema.py",
}
#: Modules that put a table's name into SQL as a value (an f-string or a concatenation after ``FROM``, ``JOIN``,
#: ``INTO``, ``UPDATE``, ``TABLE`` or ``TRUNCATE``) though they own no table, each with its reason. Owners may
#: build their own tables' names so, and the Synapse modules Synapse's; any other module doing it hides a table
#: from the ownership check.
TABLE_NAMES_BY_VALUE = {
    "roomstore/storage/engines.py": "the engine's catalogue questions (exists, size) about a table its caller names",
    "roomstore/storage/transaction.py": "insert_many and copy_rows write the table their caller, its owner, names",
    "roomstore/storage/stats.py": "counts each table of SCHEMA_TABLES (roomstore stats)",
    "roomstore/compaction/plan_sql.py": "planning SQL over either layout's state tables, named by each layout's SQL",
}
#: Not yet done (issue 43, item 1): modules that still embed an owner's table fragments (``events_as``) in
#: statements of their own, which name the table's columns. Empty now; it may only shrink: the test fails on an
#: entry that no longer applies.
TABLE_FRAGMENTS_PENDING: set[str] = set()
#: Composed reads (issue 43): a statement that joins several tables lives, as a named statement or a builder, in
#: the owner of the table it is about (whose rows it selects, walks or pages: the timeline's statements are the
#: events owner's, a prev-edge walk the graph's), and there names the columns it reads of the tables it joins
#: through their owners' fragments (``join_rooms``, ``join_event_ids``, ``current_memberships_as``,
#: ``snapshot_upto_sql``). Only reads: the joined table's name is its owner's text, so no statement here can write
#: it. Declared by owner (a module, or a package ending in ``/``) -> {joined table: why}; the test fails on a
#: declaration no longer needed and on a declaring module that owns no table. The read modules (``timeline``,
#: ``pagination``, ``sync``, ...) keep parameters and row handling.
COMPOSED_READS = {
    "roomstore/events/tables/events/": {
        "event_ids": "served events and stream rows carry their event ID and their redaction's",
        "rooms": "served events carry their room ID; recent pages the user's rooms by their activity",
        "visibility_snapshots": "a page searches the snapshots the viewer may see (snapshot_upto_sql's rows)",
    },
    "roomstore/events/tables/client_txns.py": {
        "event_ids": "a transaction's record is found by, and answers with, its event's ID",
    },
    "roomstore/events/tables/event_graph.py": {
        "events": "walks over the edges keep the prev events that are in the room's graph, with their orderings",
    },
    "roomstore/events/tables/room_state.py": {
        "rooms": "state and membership rows carry the room ID; the room's current group beside its extremities'",
        "state_keys": "the current-state stream's rows carry the state key",
    },
}
#: Modules whose SQL runs over a relation its caller names, not over a table: the column names they use are that
#: relation's contract, which each layout meets (so they count toward no table), and they name no table (checked).
RELATION_SQL = {
    "roomstore/compaction/plan_sql.py": "the planning reads over (state_group, room_nid, prev_state_group), a"
    " relation roomstore's state_groups and Synapse's state_group_edges both supply",
}
#: Not yet done (issue 43, item 1): modules whose SQL names columns of tables they do not own, by table (a column
#: only that table has; see :func:`foreign_column_mentions`). A table absent from every entry is owned to the
#: column. This map may only shrink: the test fails on an entry that no longer applies, and on any new mention.
COLUMNS_PENDING: dict[str, set[str]] = {}
#: Column names that tell no table though only one schema table has them, each with why.
UNTELLING_COLUMNS = {
    "name": "the engines' catalogues (sqlite_master, dbstat) have it too",
    "version": "schema_version, made in code and not in a schema file, has it too",
    "token": "the stream statements' name for a row's stream position",
}
#: Longest function, in lines (``def`` to its last line, decorators not counted).
MAX_FUNCTION_LINES = 80
#: Not yet done (issue 43, item 1): functions over the limit still to split into named steps. No exception is
#: granted here; the list may only shrink (the test fails on an entry now short enough).
LONG_FUNCTIONS_PENDING: set[str] = set()


# ---------------------------------------------------------------- the checker


def module_files(package_dir: Path, package: str) -> dict[str, Path]:
    """Every module of the package at ``package_dir``, by dotted name."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([package, *parts])] = path
    return modules


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a module of the package."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module of the package, line) for every import in ``module``."""
    path = modules[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    # The package a relative import is relative to.
    here = module if _is_package(module, modules) else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name, modules)
                if target is not None:
                    found.append((target, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = here.split(".")
                if node.level - 1 >= len(base_parts):
                    continue  # beyond the top package: not ours
                base = ".".join(base_parts[: len(base_parts) - (node.level - 1)])
                if node.module:
                    base = f"{base}.{node.module}"
            else:
                base = node.module or ""
            for alias in node.names:
                target = _known(f"{base}.{alias.name}", modules) or _known(base, modules)
                if target is not None:
                    found.append((target, node.lineno))
    return found


def import_graph(package_dir: Path, package: str) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line importing it}, self-imports left out."""
    modules = module_files(package_dir, package)
    graph: dict[str, dict[str, int]] = {}
    for module in modules:
        edges: dict[str, int] = {}
        for target, line in imports_of(module, modules):
            if target != module:
                edges[target] = min(line, edges.get(target, line))
        graph[module] = edges
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components of more than one module (each sorted), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components)


def cycle_path(graph: dict[str, dict[str, int]], component: Iterable[str]) -> list[str]:
    """A shortest cycle through the first module of a component: [a, b, ..., a]."""
    members = set(component)
    start = min(members)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(members)}")


def describe_cycles(graph: dict[str, dict[str, int]]) -> list[str]:
    """One line per import cycle: its path with the importing lines, and its members."""
    lines = []
    for component in strongly_connected(graph):
        path = cycle_path(graph, component)
        steps = " -> ".join(f"{a} (line {graph[a][b]})" for a, b in pairwise(path)) + f" -> {path[-1]}"
        extra = (
            f"; {len(component)} modules in this knot: {', '.join(component)}" if len(component) > len(path) - 1 else ""
        )
        lines.append(steps + extra)
    return lines


def forbidden_imports(graph: dict[str, dict[str, int]], lower: Iterable[str], upper: Iterable[str]) -> list[str]:
    """``module (line N) imports target`` for every module under ``lower`` importing under ``upper``."""

    def under(name: str, roots: Iterable[str]) -> bool:
        return any(name == root or name.startswith(root + ".") for root in roots)

    lower, upper = tuple(lower), tuple(upper)
    return [
        f"{module} (line {line}) imports {target}"
        for module in sorted(graph)
        if under(module, lower)
        for target, line in sorted(graph[module].items())
        if under(target, upper)
    ]


def oversized(package_dir: Path, package: str, limit: int) -> list[tuple[str, int]]:
    """(path, lines) of every module longer than ``limit`` lines, longest first."""
    sizes = []
    for path in module_files(package_dir, package).values():
        count = len(path.read_text(encoding="utf-8").splitlines())
        if count > limit:
            sizes.append((str(path.relative_to(package_dir.parent)), count))
    return sorted(sizes, key=lambda item: (-item[1], item[0]))


# ---------------------------------------------------------------- the schema's tables


def schema_tables(schema_dir: Path) -> set[str]:
    """Every table a schema file creates (full schemas and deltas, both
    engines), by its final name: those a delta builds only to rename over an
    old one are not counted apart (``schema_columns``)."""
    return set(schema_columns([schema_dir]))


def owned_by(relative: str, owner: str | None) -> bool:
    """Whether the module at ``relative`` is ``owner``: that module, or one of its modules when ``owner`` is a
    package (written with a trailing ``/``: an owner split by concern, one module per concern)."""
    if owner is None:
        return False
    return relative == owner or (owner.endswith("/") and relative.startswith(owner))


def owner_files(root: Path, owner: str) -> list[Path]:
    """The module files of ``owner`` (a module, or every module of a package owner)."""
    path = root / owner
    return sorted(path.rglob("*.py")) if owner.endswith("/") else [path]


def documented_owners(doc: str) -> dict[str, str]:
    """table -> owning module, from the rows ``| `table` | `module` | ...`` of
    the section "Who owns which tables" of docs/architecture.md."""
    if "## Who owns which tables" not in doc:
        raise AssertionError('docs/architecture.md has no section "## Who owns which tables"')
    section = doc.split("## Who owns which tables", 1)[1].split("\n## ", 1)[0]
    owners = {}
    for match in re.finditer(r"^\|\s*`([a-z_0-9]+)`\s*\|\s*`([a-z_./0-9]+)`", section, re.M):
        owners[match.group(1)] = match.group(2)
    return owners


# ---------------------------------------------------------------- who names which table in SQL

#: SQL keywords after which a table's name stands. Upper case only: the code writes SQL in upper case, and prose
#: ("read from rooms") must not count.
_TABLE_AFTER = re.compile(r"\b(?:FROM|JOIN|INTO|UPDATE|TABLE|TRUNCATE)\s+([A-Za-z_][A-Za-z0-9_]*)")


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def table_mentions(path: Path, tables: set[str]) -> list[tuple[str, int]]:
    """(table, line) for each schema table that the module at ``path`` names in SQL: in a string (the constant
    parts of f-strings included; docstrings not) after a SQL keyword, or as the first string argument of a call
    in ``TABLE_CALLS``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            found += [
                (name.lower(), node.lineno) for name in _TABLE_AFTER.findall(node.value) if name.lower() in tables
            ]
        elif isinstance(node, ast.Call) and _call_name(node) in TABLE_CALLS:
            first = next((a for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)), None)
            if first is not None and first.value in tables:
                found.append((first.value, node.lineno))
    return sorted(found, key=lambda item: (item[1], item[0]))


def foreign_table_mentions(
    root: Path,
    package: str,
    owners: dict[str, str],
    exempt: Iterable[str] = (),
    second_homes: dict[str, str] | None = None,
) -> list[str]:
    """ "path:line names table (owner: module)" for every mention of a table in SQL outside its owner (and
    outside its second home in ``second_homes``, table -> module, if it has one)."""
    tables = set(owners)
    second_homes = second_homes or {}
    wrong = []
    for path in sorted(module_files(root / package, package).values()):
        relative = str(path.relative_to(root))
        if relative in exempt:
            continue
        for table, line in table_mentions(path, tables):
            if not (owned_by(relative, owners[table]) or relative == second_homes.get(table)):
                wrong.append(f"{relative}:{line} names {table} (owner: {owners[table]})")
    return wrong


#: A SQL keyword after which a table's name stands, at the end of a string part.
_KEYWORD_AT_END = re.compile(r"\b(?:FROM|JOIN|INTO|UPDATE|TABLE|TRUNCATE)\s*$")


def _ends_with_keyword(node: ast.AST) -> bool:
    """Whether ``node`` is a string whose text ends with a SQL keyword a table's name follows."""
    while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        node = node.right
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(_KEYWORD_AT_END.search(node.value))


def table_names_by_value(path: Path) -> list[int]:
    """Lines where the module at ``path`` puts a value where SQL wants a table's name: ``f"... FROM {x}"`` or
    ``"... FROM " + x``."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.JoinedStr):
            pairs = zip(node.values, node.values[1:], strict=False)
            if any(_ends_with_keyword(a) and isinstance(b, ast.FormattedValue) for a, b in pairs):
                lines.add(node.lineno)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            if _ends_with_keyword(node.left) and not isinstance(node.right, (ast.Constant, ast.JoinedStr)):
                lines.add(node.lineno)
    return sorted(lines)


def long_functions(package_dir: Path, package: str, limit: int) -> dict[str, int]:
    """``path:line name`` -> lines, for every function or method longer than ``limit`` lines."""
    found = {}
    for path in sorted(module_files(package_dir, package).values()):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > limit:
                    found[f"{path.relative_to(package_dir.parent)} {node.name}"] = length
    return found


_CREATE = re.compile(r"\bCREATE\s+(?:UNLOGGED\s+)?TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?([A-Za-z_]\w*)\s*\(", re.I)
_ADD_COLUMN = re.compile(r"\bALTER\s+TABLE\s+([A-Za-z_]\w*)\s+ADD\s+(?:COLUMN\s+)?([A-Za-z_]\w*)", re.I)
_RENAME = re.compile(r"\bALTER\s+TABLE\s+([A-Za-z_]\w*)\s+RENAME\s+TO\s+([A-Za-z_]\w*)", re.I)
_NOT_COLUMNS = {"primary", "unique", "foreign", "check", "constraint", "exclude"}


def _definitions(text: str, start: int) -> list[str]:
    """The comma-separated parts of the parenthesised list opening just before ``start``."""
    depth, begin, parts = 1, start, []
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return [*parts, text[begin:i]]
        elif text[i] == "," and depth == 1:
            parts.append(text[begin:i])
            begin = i + 1
    raise AssertionError("unbalanced CREATE TABLE")


def schema_columns(schema_dirs: Iterable[Path]) -> dict[str, set[str]]:
    """table -> its columns, from the schema files (``CREATE TABLE`` and ``ADD COLUMN``; a table built under
    another name and renamed over an old one has its columns under the final name)."""
    columns: dict[str, set[str]] = {}
    renames = []
    for path in sorted(p for d in schema_dirs for p in d.rglob("*.sql")):
        text = re.sub(r"--[^\n]*", "", path.read_text(encoding="utf-8"))
        for match in _CREATE.finditer(text):
            names = {part.split()[0].lower() for part in _definitions(text, match.end()) if part.split()}
            columns.setdefault(match.group(1).lower(), set()).update(names - _NOT_COLUMNS)
        for table, column in _ADD_COLUMN.findall(text):
            columns.setdefault(table.lower(), set()).add(column.lower())
        renames += [(a.lower(), b.lower()) for a, b in _RENAME.findall(text)]
    for old, new in renames:
        columns[new] = columns.get(new, set()) | columns.pop(old, set())
    return columns


#: A string is SQL (for the column check) when it holds one of these, in upper case as the code writes SQL.
_SQL_WORDS = re.compile(r"\b(?:SELECT|INSERT|UPDATE|DELETE|WHERE|JOIN|ORDER BY|GROUP BY|SET|VALUES|RETURNING)\b")


def foreign_column_mentions(
    root: Path,
    package: str,
    owners: dict[str, str],
    columns: dict[str, set[str]],
    exempt: Iterable[str] = (),
    untelling: Iterable[str] = (),
) -> dict[str, dict[str, set[str]]]:
    """module -> {table: its columns the module names} for SQL naming a table's columns outside its owner.

    A column counts when only one table has a column of that name (``room_nid`` says nothing of which table;
    ``topological_ordering`` is ``events``') and it is not also a table's name; it counts in any string holding
    SQL (docstrings not), as ``alias.column`` or bare."""
    holders: dict[str, set[str]] = {}
    for table, names in columns.items():
        for name in names:
            holders.setdefault(name, set()).add(table)
    untelling = set(untelling) | set(columns)
    telling = {name: next(iter(ts)) for name, ts in holders.items() if len(ts) == 1 and name not in untelling}
    found: dict[str, dict[str, set[str]]] = {}
    for path in sorted(module_files(root / package, package).values()):
        relative = str(path.relative_to(root))
        if relative in exempt:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _docstrings(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
                continue
            if not _SQL_WORDS.search(node.value):
                continue
            for word in re.findall(r"\b[a-z_][a-z0-9_]*\b", node.value):
                table = telling.get(word)
                if table is not None and table in owners and not owned_by(relative, owners[table]):
                    found.setdefault(relative, {}).setdefault(table, set()).add(word)
    return found


def redefinitions(package_dir: Path, package: str) -> list[str]:
    """ "path:line name (first defined at line N)" for each top-level def or class defined again in its module."""
    found = []
    for path in sorted(module_files(package_dir, package).values()):
        seen: dict[str, int] = {}
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name in seen:
                    found.append(
                        f"{path.relative_to(package_dir.parent)}:{node.lineno} {node.name}"
                        f" (first defined at line {seen[node.name]})"
                    )
                seen.setdefault(node.name, node.lineno)
    return found


# ---------------------------------------------------------------- the real tree


class RoomstoreShapeTests(unittest.TestCase):
    """roomstore/ as it stands."""

    def setUp(self):
        self.graph = import_graph(ROOT / PACKAGE, PACKAGE)

    def test_reads_the_whole_package(self):
        # A guard against a checker that silently reads nothing.
        self.assertIn("roomstore.storage.database", self.graph)
        self.assertIn("roomstore.storage.engines", self.graph["roomstore.storage.database"])
        self.assertGreater(sum(len(edges) for edges in self.graph.values()), 100)

    def test_no_import_cycles(self):
        cycles = describe_cycles(self.graph)
        if cycles:
            self.fail(f"{len(cycles)} import cycle(s) in roomstore/:\n  " + "\n  ".join(cycles))

    def test_store_does_not_import_replication_compaction_or_synapse_reader(self):
        wrong = forbidden_imports(self.graph, STORE, ABOVE_STORE)
        if wrong:
            self.fail(
                "the store imports what sits above it (move the code down, or invert the call):\n  "
                + "\n  ".join(wrong)
            )

    def test_the_visibility_oracle_stands_apart(self):
        # rules.py checks the store's visibility code: it imports none of it, and no module of the store uses it.
        self.assertEqual([t for t in self.graph["roomstore.visibility.rules"] if t.startswith("roomstore.")], [])
        users = sorted(m for m, targets in self.graph.items() if "roomstore.visibility.rules" in targets)
        self.assertEqual(users, [])

    def test_demo_data_is_the_command_lines_alone(self):
        wrong = [
            f"{module} imports {target}"
            for module, targets in sorted(self.graph.items())
            if not module.startswith(("roomstore.cli.", "roomstore.demo."))
            for target in targets
            if target == "roomstore.demo" or target.startswith("roomstore.demo.")
        ]
        self.assertEqual(wrong, [], "only the command line's demo commands use the generated sample (roomstore.demo)")

    def test_homeserver_uses_the_public_face_only(self):
        self.assertIn(HOMESERVER, self.graph, "the homeserver package roomstore.homeserver is missing")

        def allowed(name: str) -> bool:
            return name in HOMESERVER_MAY_IMPORT_PACKAGES or any(
                name == a or name.startswith(a + ".") for a in HOMESERVER_MAY_IMPORT
            )

        wrong = forbidden_imports(
            self.graph, [HOMESERVER], sorted(m for m in self.graph if m != PACKAGE and not allowed(m))
        )
        if wrong:
            self.fail(
                "the homeserver imports the store's internals (use RoomStore's public face):\n  " + "\n  ".join(wrong)
            )
        users = sorted(
            m
            for m in self.graph
            if not (m == HOMESERVER or m.startswith(HOMESERVER + "."))
            and m != PACKAGE
            and not m.startswith("roomstore.cli")
        )
        wrong = forbidden_imports(self.graph, users, [HOMESERVER])
        self.assertEqual(wrong, [], "only the command line may import the homeserver")

    def test_synapse_reader_uses_the_public_face(self):
        # docs/architecture.md: an importer like any embedder, plus storage's URL helpers and errors.
        def allowed(name: str) -> bool:
            return name == PACKAGE or any(name == a or name.startswith(a + ".") for a in SYNAPSE_DB_MAY_IMPORT)

        readers = sorted(m for m in self.graph if m == SYNAPSE_DB or m.startswith(SYNAPSE_DB + "."))
        self.assertTrue(readers, "the package roomstore.synapse_db is missing")
        wrong = [
            f"{module} (line {line}) imports {target}"
            for module in readers
            for target, line in sorted(self.graph[module].items())
            if not allowed(target)
        ]
        self.assertEqual(wrong, [], "synapse_db imports the store's internals (use roomstore's public face)")

    def test_foundation_imports_only_what_is_beneath_it(self):
        # storage is the bottom; streams, state and visibility stand on it alone.
        beneath = {
            "roomstore.storage": ("roomstore.storage",),
            "roomstore.streams": ("roomstore.streams", "roomstore.storage"),
            "roomstore.state": ("roomstore.state", "roomstore.storage"),
            "roomstore.visibility": ("roomstore.visibility", "roomstore.storage"),
        }
        everything = sorted({m for m in self.graph if m != PACKAGE})
        wrong = []
        for package, allowed in beneath.items():
            above = [m for m in everything if not any(m == a or m.startswith(a + ".") for a in allowed)]
            wrong += forbidden_imports(self.graph, [package], above)
        if wrong:
            self.fail("a foundation package imports what stands on it:\n  " + "\n  ".join(wrong))

    def test_no_module_over_700_lines(self):
        big = oversized(ROOT / PACKAGE, PACKAGE, MAX_LINES)
        if big:
            self.fail(
                f"{len(big)} module(s) over {MAX_LINES} lines (split them by concern):\n  "
                + "\n  ".join(f"{path}: {lines} lines" for path, lines in big)
            )

    def test_every_table_has_a_documented_owner(self):
        doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
        tables = set().union(*(schema_tables(ROOT / PACKAGE / d) for d in SCHEMA_DIRS))
        self.assertGreater(len(tables), 10)
        self.assertIn("hs_users", tables)
        owners = documented_owners(doc)
        missing = sorted(tables - set(owners))
        self.assertEqual(missing, [], "tables of roomstore/schema/ with no row in docs/architecture.md's owner table")
        stale = sorted(set(owners) - tables)
        self.assertEqual(stale, [], "rows of docs/architecture.md's owner table naming no table of the schema")
        for table, owner in sorted(owners.items()):
            path = ROOT / owner
            self.assertTrue(path.exists(), f"{table}: owner {owner} does not exist")

    def test_one_list_of_the_schemas_tables(self):
        # roomstore.storage.schema.SCHEMA_TABLES is the one list (stats, tests, benchmarks read it): the schema's.
        from roomstore.storage.schema import SCHEMA_TABLES

        self.assertEqual(len(SCHEMA_TABLES), len(set(SCHEMA_TABLES)), "SCHEMA_TABLES lists a table twice")
        created = schema_tables(ROOT / PACKAGE / "schema") - {"schema_version", "applied_schema_deltas"}
        self.assertEqual(sorted(set(SCHEMA_TABLES) ^ created), [], "SCHEMA_TABLES differs from the schema files")

    def test_each_tables_sql_is_in_its_owner_only(self):
        owners = documented_owners((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
        for table in ("events", "state_groups", "room_memberships"):
            # A guard against a scan that silently finds nothing: each owner names its table.
            named = {t for path in owner_files(ROOT, owners[table]) for t, _ in table_mentions(path, set(owners))}
            self.assertIn(table, named)
        wrong = foreign_table_mentions(ROOT, PACKAGE, {**owners, **BOOKKEEPING_OWNERS}, SYNAPSE_SQL, SECOND_HOMES)
        if wrong:
            self.fail(
                f"{len(wrong)} SQL mention(s) of a table outside its owner (call the owner, or embed a fragment it"
                " builds):\n  " + "\n  ".join(wrong)
            )

    def test_table_names_by_value_only_where_declared(self):
        owners = documented_owners((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
        allowed = {*owners.values(), *SECOND_HOMES.values(), *BOOKKEEPING_OWNERS.values(), *SYNAPSE_SQL}
        allowed |= set(TABLE_NAMES_BY_VALUE)
        found = {}
        for path in module_files(ROOT / PACKAGE, PACKAGE).values():
            lines = table_names_by_value(path)
            if lines:
                found[str(path.relative_to(ROOT))] = lines
        self.assertIn("roomstore/storage/stats.py", found)  # a guard against a scan that finds nothing
        wrong = [
            f"{module}:{line}"
            for module, lines in sorted(found.items())
            if module not in TABLE_FRAGMENTS_PENDING and not any(owned_by(module, home) for home in allowed)
            for line in lines
        ]
        self.assertEqual(wrong, [], "a table's name put into SQL as a value outside its owner (call the owner)")
        stale = sorted(TABLE_FRAGMENTS_PENDING - set(found))
        self.assertEqual(stale, [], "TABLE_FRAGMENTS_PENDING names modules that no longer need it: drop them")

    def test_each_tables_columns_are_named_in_its_owner_only(self):
        owners = documented_owners((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
        owners = {**owners, **BOOKKEEPING_OWNERS}
        columns = schema_columns(ROOT / PACKAGE / d for d in SCHEMA_DIRS)
        self.assertIn("topological_ordering", columns["events"])  # a guard against a parse that finds nothing
        exempt = (*SYNAPSE_SQL, *RELATION_SQL)
        found = foreign_column_mentions(ROOT, PACKAGE, owners, columns, exempt, UNTELLING_COLUMNS)
        for table, home in SECOND_HOMES.items():
            if table in found.get(home, {}):
                del found[home][table]
        composed = set()
        for module, tables in found.items():
            for reader, joined in COMPOSED_READS.items():
                if owned_by(module, reader):
                    composed |= {(reader, table) for table in tables if table in joined}
                    found[module] = {table: names for table, names in tables.items() if table not in joined}
        wrong = [
            f"{module} names {', '.join(sorted(names))} of {table} (owner: {owners[table]})"
            for module, tables in sorted(found.items())
            for table, names in sorted(tables.items())
            if table not in COLUMNS_PENDING.get(module, set())
        ]
        self.assertEqual(wrong, [], "SQL naming a table's columns outside its owner (move the statement there)")
        stale = [
            f"{module}: {table}"
            for module, tables in sorted(COLUMNS_PENDING.items())
            for table in sorted(tables)
            if table not in found.get(module, {})
        ]
        self.assertEqual(stale, [], "COLUMNS_PENDING lists what is owned to the column now: drop it")
        declared = {(reader, table) for reader, joined in COMPOSED_READS.items() for table in joined}
        self.assertEqual(sorted(declared - composed), [], "COMPOSED_READS declares reads no statement makes: drop them")

    def test_composed_reads_are_owners_and_relation_sql_names_no_table(self):
        owners = documented_owners((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
        for reader in COMPOSED_READS:
            self.assertIn(reader, set(owners.values()), f"COMPOSED_READS: {reader} owns no table")
        for module in RELATION_SQL:
            self.assertEqual(table_mentions(ROOT / module, set(owners)), [], f"{module} names a table")

    def test_no_function_over_80_lines(self):
        long = long_functions(ROOT / PACKAGE, PACKAGE, MAX_FUNCTION_LINES)
        wrong = [f"{name}: {lines} lines" for name, lines in sorted(long.items()) if name not in LONG_FUNCTIONS_PENDING]
        self.assertEqual(wrong, [], f"functions over {MAX_FUNCTION_LINES} lines: split them into named steps")
        stale = sorted(set(LONG_FUNCTIONS_PENDING) - set(long))
        self.assertEqual(stale, [], "LONG_FUNCTIONS_PENDING names functions now short enough: drop them")

    def test_second_homes_are_documented(self):
        doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
        for table, home in sorted(SECOND_HOMES.items()):
            self.assertTrue((ROOT / home).exists(), f"{table}: second home {home} does not exist")
            row = re.search(rf"^\|\s*`{table}`\s*\|.*$", doc, re.M)
            self.assertIsNotNone(row, f"{table}: no row in docs/architecture.md's owner table")
            self.assertIn(f"`{home}`", row.group(0), f"{table}: its row in docs/architecture.md does not name {home}")

    def test_no_module_defines_a_name_twice(self):
        twice = redefinitions(ROOT / PACKAGE, PACKAGE)
        if twice:
            self.fail("top-level names defined twice (the later one silently wins):\n  " + "\n  ".join(twice))

    def test_pure_pdu_code_imports_nothing_else_of_roomstore(self):
        self.assertIn("roomstore.pdu", self.graph, "the pure PDU package roomstore.pdu is missing")
        others = sorted(
            {m for m in self.graph if m != PACKAGE and not (m == "roomstore.pdu" or m.startswith("roomstore.pdu."))}
        )
        wrong = forbidden_imports(self.graph, ["roomstore.pdu"], others)
        if wrong:
            self.fail("the pure PDU package imports the rest of roomstore:\n  " + "\n  ".join(wrong))

    def test_state_resolution_imports_only_pdu(self):
        self.assertIn("roomstore.resolution", self.graph, "the pure package roomstore.resolution is missing")
        allowed = ("roomstore.resolution", "roomstore.pdu")
        others = sorted(
            {m for m in self.graph if m != PACKAGE and not any(m == a or m.startswith(a + ".") for a in allowed)}
        )
        wrong = forbidden_imports(self.graph, ["roomstore.resolution"], others)
        if wrong:
            self.fail("state resolution imports more of roomstore than roomstore.pdu:\n  " + "\n  ".join(wrong))


# ---------------------------------------------------------------- the checker, on made-up packages


class CheckerTests(unittest.TestCase):
    """The checker finds what it should, in every import form."""

    def make_package(self, files: dict[str, str]) -> Path:
        root = Path(self.mktemp()) / "pkg"
        for name, text in {"__init__.py": "", **files}.items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text), encoding="utf-8")
        return root

    def test_cycle_through_every_import_form(self):
        # a -> b (relative, at the top), b -> c (inside a function),
        # c -> a (absolute, under TYPE_CHECKING): a cycle of three.
        root = self.make_package(
            {
                "a.py": "from . import b\n",
                "b.py": "def later():\n    from pkg.sub import c\n    return c\n",
                "sub/__init__.py": "",
                "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
                "d.py": "import pkg.a\n",  # into the cycle, not part of it
            }
        )
        graph = import_graph(root, "pkg")
        self.assertEqual(graph["pkg.a"], {"pkg.b": 1})
        self.assertEqual(graph["pkg.b"], {"pkg.sub.c": 2})
        self.assertEqual(graph["pkg.sub.c"], {"pkg.a": 3})
        self.assertEqual(strongly_connected(graph), [["pkg.a", "pkg.b", "pkg.sub.c"]])
        self.assertEqual(
            describe_cycles(graph),
            ["pkg.a (line 1) -> pkg.b (line 2) -> pkg.sub.c (line 3) -> pkg.a"],
        )

    def test_two_module_cycle_with_relative_parent_import(self):
        root = self.make_package(
            {
                "store.py": "from pkg.events.reads import Reader\n",
                "events/__init__.py": "",
                "events/reads.py": "from ..store import Store\n",
            }
        )
        graph = import_graph(root, "pkg")
        self.assertEqual(
            describe_cycles(graph), ["pkg.events.reads (line 1) -> pkg.store (line 1) -> pkg.events.reads"]
        )

    def test_knot_larger_than_its_shortest_cycle(self):
        root = self.make_package(
            {
                "a.py": "import pkg.b\nimport pkg.c\n",
                "b.py": "import pkg.a\n",
                "c.py": "import pkg.a\n",
            }
        )
        (line,) = describe_cycles(import_graph(root, "pkg"))
        self.assertEqual(line, "pkg.a (line 1) -> pkg.b (line 1) -> pkg.a; 3 modules in this knot: pkg.a, pkg.b, pkg.c")

    def test_no_cycle(self):
        # A package re-exporting its module, imported by its siblings: no cycle.
        root = self.make_package(
            {
                "__init__.py": "from pkg.low import thing\n",
                "low.py": "thing = 1\n",
                "high.py": "from pkg import thing\nfrom pkg.low import thing as again\nimport os, json\n",
            }
        )
        graph = import_graph(root, "pkg")
        self.assertEqual(graph["pkg.high"], {"pkg": 1, "pkg.low": 2})
        self.assertEqual(describe_cycles(graph), [])

    def test_forbidden_imports(self):
        root = self.make_package(
            {
                "store/__init__.py": "",
                "store/db.py": "x = 1\n",
                "store/reads.py": "import pkg.store.db\n\ndef f():\n    from pkg.replication import wire\n",
                "replication/__init__.py": "",
                "replication/wire.py": "from pkg.store import db\n",
            }
        )
        graph = import_graph(root, "pkg")
        self.assertEqual(
            forbidden_imports(graph, ["pkg.store"], ["pkg.replication"]),
            ["pkg.store.reads (line 4) imports pkg.replication.wire"],
        )
        self.assertEqual(forbidden_imports(graph, ["pkg.replication"], ["pkg.nothing"]), [])

    def test_oversized(self):
        root = self.make_package({"small.py": "x = 1\n" * 700, "big.py": "x = 1\n" * 701})
        self.assertEqual(oversized(root, "pkg", 700), [("pkg/big.py", 701)])

    def test_schema_tables_and_owners(self):
        root = self.make_package({})
        schema = root / "schema"
        (schema / "deltas" / "2").mkdir(parents=True)
        (schema / "full.sql").write_text(
            "-- CREATE TABLE commented_out (x INT);\nCREATE TABLE one (x INT);\n"
            "create table if not exists Two (y INT);\n"
        )
        (schema / "deltas" / "2" / "01.postgres.sql").write_text("CREATE UNLOGGED TABLE three (z INT);\n")
        self.assertEqual(schema_tables(schema), {"one", "two", "three"})
        doc = (
            "# x\n## Who owns which tables\n\n| table | owner |\n| --- | --- |\n"
            "| `one` | `pkg/a.py` | note |\n| `two` | `pkg/b.py` |\n\n## Next\n| `three` | `pkg/c.py` |\n"
        )
        self.assertEqual(documented_owners(doc), {"one": "pkg/a.py", "two": "pkg/b.py"})

    def test_table_mentions_outside_their_owner(self):
        root = self.make_package(
            {
                "owner.py": 'READ = "SELECT a FROM one JOIN two USING (a)"\n',
                "other.py": (
                    '"""Reads FROM one, in a docstring: not SQL."""\n'
                    "def f(txn, t):\n"
                    '    """INSERT INTO one: a docstring."""\n'
                    '    txn.execute(f"UPDATE two SET a = {t} WHERE a IN (SELECT a FROM one)")\n'
                    '    txn.insert_many("one", ("a",), [])\n'
                    '    log("read from one")  # prose in lower case\n'
                    '    return Interner("three", "nid", ["x"], 1)\n'
                ),
                "synapse.py": 'Q = "SELECT * FROM one"\n',
            }
        )
        owners = {"one": "pkg/owner.py", "two": "pkg/owner.py", "three": "pkg/owner.py"}
        self.assertEqual(
            foreign_table_mentions(root.parent, "pkg", owners, ["pkg/synapse.py"]),
            [
                "pkg/other.py:4 names one (owner: pkg/owner.py)",
                "pkg/other.py:4 names two (owner: pkg/owner.py)",
                "pkg/other.py:5 names one (owner: pkg/owner.py)",
                "pkg/other.py:7 names three (owner: pkg/owner.py)",
            ],
        )
        self.assertEqual(
            foreign_table_mentions(root.parent, "pkg", {**owners, "one": "pkg/other.py"}, ["pkg/synapse.py"])[:1],
            ["pkg/other.py:4 names two (owner: pkg/owner.py)"],
        )
        # A second home lets that module name that table, and no other: other.py may name two, not one.
        self.assertEqual(
            foreign_table_mentions(root.parent, "pkg", owners, ["pkg/synapse.py"], {"two": "pkg/other.py"}),
            [
                "pkg/other.py:4 names one (owner: pkg/owner.py)",
                "pkg/other.py:5 names one (owner: pkg/owner.py)",
                "pkg/other.py:7 names three (owner: pkg/owner.py)",
            ],
        )

    def test_a_package_may_own_a_table(self):
        root = self.make_package(
            {
                "owner/__init__.py": "",
                "owner/reads.py": 'READ = "SELECT e.topo FROM ev AS e"\n',
                "owner/writes.py": 'WRITE = "UPDATE ev SET topo = ?"\n',
                "other.py": 'A = "SELECT topo FROM ev"\n',
            }
        )
        self.assertTrue(owned_by("pkg/owner/reads.py", "pkg/owner/"))
        self.assertFalse(owned_by("pkg/owner_two.py", "pkg/owner/"))
        self.assertFalse(owned_by("pkg/owner/reads.py", "pkg/owner"))
        self.assertEqual(len(owner_files(root.parent, "pkg/owner/")), 3)
        self.assertEqual(
            foreign_table_mentions(root.parent, "pkg", {"ev": "pkg/owner/"}),
            ["pkg/other.py:1 names ev (owner: pkg/owner/)"],
        )
        columns = {"ev": {"topo"}, "other": {"x"}}
        self.assertEqual(
            foreign_column_mentions(root.parent, "pkg", {"ev": "pkg/owner/"}, columns),
            {"pkg/other.py": {"ev": {"topo"}}},
        )

    def test_redefinitions(self):
        root = self.make_package(
            {
                "a.py": "def f(x):\n    return x\n\nclass C:\n    def m(self): ...\n    def m(self): ...\n\n"
                "def f(x, y):\n    return y\n",
                "b.py": "def g(): ...\n",
            }
        )
        self.assertEqual(redefinitions(root, "pkg"), ["pkg/a.py:8 f (first defined at line 1)"])

    def test_table_names_by_value(self):
        root = self.make_package(
            {
                "a.py": (
                    "def f(txn, table, n):\n"
                    '    txn.execute(f"SELECT MAX(id) FROM {table} WHERE x > {n}")\n'
                    '    txn.execute("DELETE FROM " + table)\n'
                    '    txn.execute(f"SELECT x FROM rooms WHERE y = {n}")\n'
                    '    return "SELECT " + "a FROM b"\n'
                ),
            }
        )
        self.assertEqual(table_names_by_value(root / "a.py"), [2, 3])

    def test_long_functions(self):
        short = "def short():\n" + "    x = 1\n" * 79  # 80 lines: at the limit
        long = "class C:\n    def long(self):\n" + "        x = 1\n" * 80  # 81 lines
        root = self.make_package({"a.py": short + "\n\n" + long})
        self.assertEqual(long_functions(root, "pkg", 80), {"pkg/a.py long": 81})

    def test_foreign_column_mentions(self):
        root = self.make_package(
            {
                "owner.py": 'READ = "SELECT e.depth, e.topo FROM ev AS e"\n',
                "other.py": (
                    '"""Reads topo, in a docstring: not SQL."""\n'
                    'A = "SELECT x.topo FROM somewhere AS x WHERE x.room = ?"\n'
                    'B = "the topo, in prose without SQL words"\n'
                    'C = "SELECT rm.nick FROM rm"\n'
                ),
            }
        )
        schema = root / "schema"
        schema.mkdir()
        (schema / "1.sql").write_text(
            "CREATE TABLE ev (room INT, depth INT, topo INT, PRIMARY KEY (room, depth));\n"
            "CREATE TABLE ev_new (room INT, extra INT);\nALTER TABLE ev_new RENAME TO rm;\n"
            "-- CREATE TABLE gone (zzz INT);\nALTER TABLE rm ADD COLUMN nick TEXT;\n"
        )
        columns = schema_columns([schema])
        self.assertEqual(columns, {"ev": {"room", "depth", "topo"}, "rm": {"room", "extra", "nick"}})
        owners = {"ev": "pkg/owner.py", "rm": "pkg/owner.py"}
        # room is in both tables (tells nothing); depth is untelling here; topo and nick are named outside.
        self.assertEqual(
            foreign_column_mentions(root.parent, "pkg", owners, columns, untelling=["depth"]),
            {"pkg/other.py": {"ev": {"topo"}, "rm": {"nick"}}},
        )
