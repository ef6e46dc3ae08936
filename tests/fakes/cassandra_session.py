"""An in-memory stand-in for a cassandra-driver ``Session``, for tests where no Cassandra
server can be installed on the machines this suite runs on (no CQL server ships in the
package registries they reach). It is faithful where the store depends on the driver:

- ``prepare`` returns the driver's own ``PreparedStatement`` with bind metadata built from
  the real DDL (``stores/transcripts/schema.cql``), so ``bind`` serializes values with the
  driver's CQL types and rejects wrong arity or types exactly as it would against a server;
- ``execute_async`` takes the driver's ``BoundStatement`` / ``BatchStatement``, decodes the
  serialized values back with those types, and answers through a ``ResponseFuture``-shaped
  object (``add_callbacks``);
- tables keep Cassandra's semantics for what the store uses: upsert by primary key,
  clustering order, ``>`` slices on clustering columns (also as a tuple), ``LIMIT``,
  ``USING TIMESTAMP`` last-write-wins, and ``USING TTL`` (recorded).

``fail_next`` injects the driver's transient errors for retry tests. The same store tests
run against a real cluster when ``TOKENBUS_CASSANDRA_CONTACT_POINTS`` is set.
"""

from __future__ import annotations

import itertools
import re
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Any

from cassandra import cqltypes
from cassandra.protocol import ColumnMetadata
from cassandra.query import BatchStatement, BoundStatement, PreparedStatement

PROTOCOL_VERSION = 4
CQL_TYPES = {"text": cqltypes.UTF8Type, "bigint": cqltypes.LongType, "int": cqltypes.Int32Type}
SPECIAL = {"[ttl]": cqltypes.Int32Type, "[timestamp]": cqltypes.LongType, "[limit]": cqltypes.Int32Type}


@dataclass
class Table:
    keyspace: str
    name: str
    columns: dict[str, type]
    partition_key: list[str]
    clustering: list[str]
    rows: dict[tuple, dict[str, Any]] = field(default_factory=dict)
    write_times: dict[tuple, int] = field(default_factory=dict)
    ttls: dict[tuple, int] = field(default_factory=dict)

    @property
    def key_columns(self) -> list[str]:
        return self.partition_key + self.clustering


@dataclass
class Plan:
    kind: str  # insert or select
    table: Table
    binds: list[str]  # column (or [ttl]/[timestamp]/[limit]) for each ?
    columns: list[str]  # insert: written columns; select: returned columns
    conditions: list[tuple[tuple[str, ...], str]] = field(default_factory=list)  # (columns, op)


class FakeResponseFuture:
    def __init__(self, rows: list | None = None, error: BaseException | None = None) -> None:
        self._rows, self._error = rows, error

    def add_callbacks(self, callback, errback) -> None:
        if self._error is not None:
            errback(self._error)
        else:
            callback(self._rows)

    def result(self):
        if self._error is not None:
            raise self._error
        return self._rows


class FakeSession:
    def __init__(self, ddl: list[str]) -> None:
        self.tables: dict[str, Table] = {}
        self.plans: dict[bytes, Plan] = {}
        self.executed: list[Any] = []
        self._failures: list[BaseException] = []
        self._ids = itertools.count()
        for statement in ddl:
            if statement.upper().startswith("CREATE TABLE"):
                self._create_table(statement)

    def fail_next(self, *errors: BaseException) -> None:
        self._failures.extend(errors)

    # -- DDL --------------------------------------------------------------------------

    def _create_table(self, ddl: str) -> None:
        match = re.search(r"CREATE TABLE IF NOT EXISTS (\w+)\.(\w+) \((.*)\)\s*WITH", ddl, re.S)
        assert match, ddl
        keyspace, name, body = match.groups()
        columns: dict[str, type] = {}
        key = re.search(r"PRIMARY KEY \(\((.*?)\)(?:, (.*?))?\)", body)
        assert key, ddl
        for line in body.split(","):
            parts = line.strip().split()
            if len(parts) == 2 and parts[1] in CQL_TYPES:
                columns[parts[0]] = CQL_TYPES[parts[1]]
        partition = [c.strip() for c in key.group(1).split(",")]
        clustering = [c.strip() for c in (key.group(2) or "").split(",") if c.strip()]
        self.tables[f"{keyspace}.{name}"] = Table(keyspace, name, columns, partition, clustering)

    # -- prepare ------------------------------------------------------------------------

    def prepare(self, query: str) -> PreparedStatement:
        plan = self._plan(query)
        metadata = [ColumnMetadata(plan.table.keyspace, plan.table.name, name,
                                   SPECIAL.get(name) or plan.table.columns[name]) for name in plan.binds]
        query_id = f"q{next(self._ids)}".encode()
        self.plans[query_id] = plan
        pk_indexes = [plan.binds.index(c) for c in plan.table.partition_key if c in plan.binds] or None
        return PreparedStatement(metadata, query_id, pk_indexes, query, plan.table.keyspace, PROTOCOL_VERSION,
                                 None, None)

    def _plan(self, query: str) -> Plan:
        insert = re.fullmatch(r"INSERT INTO ([\w.]+) \((.*?)\) VALUES \((.*?)\)(?: USING (.*))?", query)
        if insert:
            table = self.tables[insert.group(1)]
            columns = [c.strip() for c in insert.group(2).split(",")]
            assert insert.group(3).count("?") == len(columns), "one ? per column"
            using = [f"[{u.split()[0].lower()}]" for u in (insert.group(4) or "").split(" AND ") if u]
            for column in columns:
                assert column in table.columns, f"unknown column {column}"
            return Plan("insert", table, columns + using, columns)
        select = re.fullmatch(r"SELECT (.*?) FROM ([\w.]+) WHERE (.*?) LIMIT \?", query)
        assert select, f"the fake does not know this statement: {query}"
        table = self.tables[select.group(2)]
        columns = [c.strip() for c in select.group(1).split(",")]
        conditions, binds = [], []
        for condition in select.group(3).split(" AND "):
            lhs, op, _ = re.fullmatch(r"(\(.*?\)|\w+) (=|>) (\(.*?\)|\?)", condition.strip()).groups()
            names = tuple(c.strip() for c in lhs.strip("()").split(","))
            conditions.append((names, op))
            binds += names
        for column in (*columns, *binds):
            assert column in table.columns, f"unknown column {column}"
        self._check_restrictions(table, conditions)
        return Plan("select", table, binds + ["[limit]"], columns, conditions)

    @staticmethod
    def _check_restrictions(table: Table, conditions: list[tuple[tuple[str, ...], str]]) -> None:
        """What a server refuses: a partition key not fully restricted by equality, or a slice
        on anything but a clustering prefix."""
        equal = {c for names, op in conditions if op == "=" for c in names}
        assert set(table.partition_key) <= equal, "partition key must be restricted by ="
        for names, op in conditions:
            if op == ">":
                assert list(names) == table.clustering[:len(names)], "slices only on a clustering prefix"

    # -- execute --------------------------------------------------------------------------

    def execute_async(self, statement: Any) -> FakeResponseFuture:
        self.executed.append(statement)
        if self._failures:
            return FakeResponseFuture(error=self._failures.pop(0))
        if isinstance(statement, BatchStatement):
            for _, query_id, values in statement._statements_and_parameters:
                self._run(self.plans[query_id], values)
            return FakeResponseFuture([])
        assert isinstance(statement, BoundStatement)
        return FakeResponseFuture(self._run(self.plans[statement.prepared_statement.query_id], statement.values))

    def _run(self, plan: Plan, serialized: list[bytes]) -> list:
        assert len(serialized) == len(plan.binds), "every ? bound"
        values = []
        for name, raw in zip(plan.binds, serialized):
            kind = SPECIAL.get(name) or plan.table.columns[name]
            values.append(None if raw is None else kind.from_binary(raw, PROTOCOL_VERSION))
        return self._insert(plan, values) if plan.kind == "insert" else self._select(plan, values)

    def _insert(self, plan: Plan, values: list) -> list:
        table = plan.table
        bound = dict(zip(plan.binds, values))
        key = tuple(bound[c] for c in table.key_columns)
        written_at = bound.get("[timestamp]", 0)
        row = table.rows.setdefault(key, {c: None for c in table.columns})
        for column in plan.columns:  # an upsert of the columns it names; each cell keeps its newest write
            if table.write_times.get((key, column), 0) <= written_at:
                row[column] = bound[column]
                table.write_times[(key, column)] = written_at
        table.ttls[key] = bound.get("[ttl]", 0)
        return []

    def _select(self, plan: Plan, values: list) -> list:
        table, position = plan.table, 0
        rows = list(table.rows.values())
        for names, op in plan.conditions:
            wanted = tuple(values[position:position + len(names)])
            position += len(names)
            if op == "=":
                rows = [r for r in rows if tuple(r[c] for c in names) == wanted]
            else:
                rows = [r for r in rows if tuple(r[c] for c in names) > wanted]
        rows.sort(key=lambda r: tuple(r[c] for c in table.clustering))
        limit = values[position]
        Row = namedtuple("Row", plan.columns)
        return [Row(*(r[c] for c in plan.columns)) for r in rows[:limit]]
