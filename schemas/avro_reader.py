"""Avro's binary decoding, compiled from a parsed schema into Python source (avro_source.py): one
function per record type whose body reads its fields in order, straight-line.

fastavro's reader walks the schema for every record it reads, a call per field; the edge and the
output moderation read a token event for every token of every stream. Reading one took 4.2 µs
compiled against 9.5 with fastavro's reader, in one run. Like the writer (avro_writer.py) it knows
what tokenbus's schemas use (primitives, records, enums, arrays, maps, and unions of null with
one other type); for any other schema ``compile_reader`` raises :class:`NotCompiled` and the
codec keeps fastavro's reader. It reads with the writer's schema only: a record written with an
older schema is resolved against the current one by fastavro.

A reader takes the bytes and where the value starts, and returns the value (as fastavro's: dicts,
lists, strings; or, for the record types it was given classes for, instances of them) and where it
ends. Malformed bytes raise ``ValueError`` (or ``IndexError`` when
they end too soon, ``UnicodeDecodeError`` for a bad string); a length read past the end shows as
an end position past the data, which the caller checks.
"""

from __future__ import annotations

import dataclasses
import keyword
import struct
import typing
from collections.abc import Callable, Mapping
from typing import Any

from tokenbus.schemas.avro_source import NotCompiled, SchemaSource, schema_name

Reader = Callable[[bytes, int], tuple[Any, int]]


def long_at(data: bytes, pos: int) -> tuple[int, int]:
    """An Avro int or long of any length (the compiled code reads one-byte ones inline)."""
    byte = data[pos]
    n, shift = byte & 0x7F, 7
    pos += 1
    while byte & 0x80:
        byte = data[pos]
        n |= (byte & 0x7F) << shift
        shift += 7
        pos += 1
    return (n >> 1) ^ -(n & 1), pos


def compile_reader(schema: Any, classes: Mapping[str, type] | None = None) -> Reader:
    """The reader of ``schema`` as fastavro's ``parse_schema`` returns it (named types defined once,
    then referred to by full name). A record type named in ``classes`` (by full name) is read as an
    instance of its class, its fields passed by name, rather than as a dict: what a caller would
    make of the dict anyway, without building it (a fifth of reading a token event). An array
    whose attribute the class annotates as a tuple is passed as one (a frozen, hashable record's)."""
    reader: Reader = _ReaderSource(classes or {}).build(schema, {
        "long_at": long_at, "unpack_float": struct.Struct("<f").unpack_from,
        "unpack_double": struct.Struct("<d").unpack_from})
    return reader


class _ReaderSource(SchemaSource):
    role = "reader"

    def __init__(self, classes: Mapping[str, type]) -> None:
        super().__init__()
        self.classes = classes

    def function_for(self, schema: Any) -> str:
        if isinstance(schema, dict) and schema.get("type") == "record":
            return self.record(schema)
        name = self.fresh("read_value")
        lines = [f"def {name}(data, pos):"]
        self.functions.append(lines)
        self.value(schema, lines, 1, "value")
        lines.append("    return value, pos")
        return name

    def record(self, schema: dict[str, Any]) -> str:
        name, lines = self.new_record(schema, "read_record", "data, pos")
        values = []
        for field in schema["fields"]:
            target = self.fresh("v")
            self.value(field["type"], lines, 1, target)
            values.append((field["name"], target))
        cls = self.classes.get(schema["name"])
        if cls is None:
            lines.append(f"    return {{{', '.join(f'{field!r}: {v}' for field, v in values)}}}, pos")
        else:
            constructor = self.fresh("record_class")
            self.constants[constructor] = cls
            tuples = _tuple_fields(cls)
            values = [(field, f"tuple({v})" if field in tuples else v) for field, v in values]
            lines.append(f"    return {constructor}({_arguments(cls, dict(values))}), pos")
        return name

    def call_record(self, function: str, lines: list[str], depth: int, target: str) -> None:
        lines.append(f"{'    ' * depth}{target}, pos = {function}(data, pos)")

    def primitive(self, kind: str, lines: list[str], depth: int, target: str) -> None:
        pad = "    " * depth
        if kind in ("int", "long"):
            self.long(lines, depth, target)
        elif kind in ("string", "bytes"):
            size = self.fresh("n")
            self.long(lines, depth, size)
            lines += [f"{pad}if {size} < 0:", f"{pad}    raise ValueError('negative length')",
                      f"{pad}{target} = data[pos:pos + {size}]{'.decode()' if kind == 'string' else ''}",
                      f"{pad}pos += {size}"]
        elif kind == "boolean":
            lines.append(f"{pad}{target} = data[pos] != 0  # as fastavro reads it")
            lines.append(f"{pad}pos += 1")
        elif kind in ("float", "double"):
            lines.append(f"{pad}{target}, = unpack_{kind}(data, pos)")
            lines.append(f"{pad}pos += {4 if kind == 'float' else 8}")
        else:  # null
            lines.append(f"{pad}{target} = None")

    def long(self, lines: list[str], depth: int, target: str) -> None:
        pad = "    " * depth
        lines += [f"{pad}byte = data[pos]", f"{pad}if byte < 0x80:  # one byte: the usual case",
                  f"{pad}    {target} = (byte >> 1) ^ -(byte & 1)", f"{pad}    pos += 1",
                  f"{pad}else:", f"{pad}    {target}, pos = long_at(data, pos)"]

    def optional(self, branches: list[Any], lines: list[str], depth: int, target: str) -> None:
        others = [b for b in branches if b != "null"]
        if len(branches) != 2 or len(others) != 1:
            raise NotCompiled(f"union {branches}")
        pad = "    " * depth
        null_byte, other_byte = 2 * branches.index("null"), 2 * branches.index(others[0])  # zigzag 0 and 1
        lines += [f"{pad}byte = data[pos]", f"{pad}pos += 1", f"{pad}if byte == {null_byte}:",
                  f"{pad}    {target} = None", f"{pad}elif byte == {other_byte}:"]
        self.value(others[0], lines, depth + 1, target)
        lines += [f"{pad}else:", f"{pad}    raise ValueError(f'union branch {{byte}}')"]

    def enum(self, schema: dict[str, Any], lines: list[str], depth: int, target: str) -> None:
        symbols = self.fresh("symbols")
        self.constants[symbols] = tuple(schema["symbols"])
        pad = "    " * depth
        index = self.fresh("i")
        self.long(lines, depth, index)
        lines += [f"{pad}if not 0 <= {index} < {len(schema['symbols'])}:",
                  f"{pad}    raise ValueError(f'enum index {{{index}}}')", f"{pad}{target} = {symbols}[{index}]"]

    def takes_a_byte(self, schema: Any) -> bool:
        if schema == "null":
            return False
        if isinstance(schema, str):
            schema = self.named.get(schema, schema)
        if isinstance(schema, dict) and schema["type"] == "record":
            return any(self.takes_a_byte(f["type"]) for f in schema["fields"])
        return True

    def blocks(self, schema: dict[str, Any], lines: list[str], depth: int, target: str) -> None:
        """An array or a map: blocks of items, each block its count first (negative: its size in
        bytes follows), until an empty block."""
        is_map = schema["type"] == "map"
        items = schema["values"] if is_map else schema["items"]
        if not self.takes_a_byte(items):  # a count of such items would not be bounded by the data
            raise NotCompiled(f"a block of {schema_name(items)}, whose items can take no bytes")
        pad = "    " * depth
        count, item, key = self.fresh("count"), self.fresh("item"), self.fresh("key")
        lines.append(f"{pad}{target} = {{}}" if is_map else f"{pad}{target} = []")
        lines.append(f"{pad}while True:")
        self.long(lines, depth + 1, count)
        lines += [f"{pad}    if {count} == 0:", f"{pad}        break", f"{pad}    if {count} < 0:",
                  f"{pad}        {count} = -{count}"]
        self.long(lines, depth + 2, "_")
        lines += [f"{pad}    if {count} > len(data) - pos:  # every item takes a byte at least",
                  f"{pad}        raise ValueError('block longer than the data')",
                  f"{pad}    for _ in range({count}):"]
        if is_map:
            self.value("string", lines, depth + 2, key)
        self.value(items, lines, depth + 2, item)
        lines.append(f"{pad}        {target}[{key}] = {item}" if is_map else f"{pad}        {target}.append({item})")


def _tuple_fields(cls: type) -> set[str]:
    """The attributes ``cls`` annotates as tuples."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception as exc:  # an annotation that names what its module does not define
        raise NotCompiled(f"the annotations of {cls.__name__}: {exc}") from exc
    return {name for name, hint in hints.items() if hint is tuple or typing.get_origin(hint) is tuple}


def _arguments(cls: type, values: dict[str, str]) -> str:
    """The arguments that make an instance of ``cls`` from a record's fields (each read into the
    expression in ``values``): in order where ``cls`` is a dataclass of exactly those fields (a
    call of 17 arguments by name took 1.2 µs, in order 0.5), by name otherwise."""
    if dataclasses.is_dataclass(cls):
        order = [f.name for f in dataclasses.fields(cls) if f.init]
        if sorted(order) == sorted(values):
            return ", ".join(values[name] for name in order)
    if not all(name.isidentifier() and not keyword.iskeyword(name) for name in values):
        raise NotCompiled(f"a field of {cls.__name__} is no Python name: it cannot be passed by name")
    return ", ".join(f"{name}={variable}" for name, variable in values.items())
