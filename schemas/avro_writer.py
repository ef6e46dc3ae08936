"""Avro's binary encoding, compiled from a parsed schema into Python source (avro_source.py): one
function per record type whose body writes its fields in order, straight-line.

fastavro's writer walks the schema for every record and, at each union, tries its branches in
turn; a GPU consumer writes a token event for every token of every sequence. Writing a token
event's body took 2.9 µs compiled against 4.3 with a tree of small writer functions and 8.6 with
fastavro's writer. It knows what tokenbus's schemas use (primitives, records, enums, arrays,
maps, and unions of null with one other type); for any other schema ``compile_writer`` raises
:class:`NotCompiled` and the codec keeps fastavro's writer.

A writer appends byte strings to a list; the caller joins them once. A value the schema does not
allow raises (``ValueError``, ``TypeError``, ``AttributeError``, ``KeyError``) rather than being
written.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from typing import Any

from tokenbus.schemas.avro_source import NotCompiled, SchemaSource

Writer = Callable[[list[bytes], Any], None]


def _zigzag_varint(n: int) -> bytes:
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# Most ints on the bus (lengths, counts, a token event's seq early on) fit one byte.
_ONE_BYTE = [_zigzag_varint(n) for n in range(-64, 64)]
# The longer ones are mostly timestamps, which the events of one millisecond share (a consumer
# writes dozens a millisecond): 0.08 µs from the cache against 0.7 µs to compute six bytes.
_long_varint = functools.lru_cache(maxsize=1024)(_zigzag_varint)


def long_bytes(n: int) -> bytes:
    """An Avro int or long: zigzag, then a base-128 varint."""
    if -64 <= n < 64:
        return _ONE_BYTE[n + 64]
    if 0 <= n < 0x100000:  # two or three bytes: token ids, most lengths, a turn's seq
        z = n << 1
        if z < 0x4000:
            return bytes(((z & 0x7F) | 0x80, z >> 7))
        return bytes(((z & 0x7F) | 0x80, ((z >> 7) & 0x7F) | 0x80, z >> 14))
    return _long_varint(n)


def _null(value: Any) -> None:
    if value is not None:
        raise ValueError(f"{value!r} for a null")


def compile_writer(schema: Any, attributes: bool = False) -> Writer:
    """The writer of ``schema`` as fastavro's ``parse_schema`` returns it (named types defined once,
    then referred to by full name). It writes a dict per record, as fastavro's does, or with
    ``attributes`` an object whose attributes are the record's fields (a record type whose Avro
    form is its fields as they are: the writer reads them where ``to_avro`` would copy them)."""
    writer: Writer = _WriterSource(attributes).build(schema, {
        "long_bytes": long_bytes, "one_byte": _ONE_BYTE, "check_null": _null,
        "pack_float": struct.Struct("<f").pack, "pack_double": struct.Struct("<d").pack})
    return writer


class _WriterSource(SchemaSource):
    role = "writer"

    def __init__(self, attributes: bool) -> None:
        super().__init__()
        self.attributes = attributes

    def function_for(self, schema: Any) -> str:
        if isinstance(schema, dict) and schema.get("type") == "record":
            return self.record(schema)
        name = self.fresh("write_value")
        lines = [f"def {name}(out, value):", "    append = out.append"]
        self.functions.append(lines)
        self.value(schema, lines, 1, "value")
        return name

    def record(self, schema: dict[str, Any]) -> str:
        name, lines = self.new_record(schema, "write_record", "out, value")
        lines.append("    append = out.append")
        for field in schema["fields"]:
            if self.attributes and not field["name"].isidentifier():
                raise NotCompiled(f"field {field['name']!r} as an attribute")
            read = f"value.{field['name']}" if self.attributes else f"value[{field['name']!r}]"
            self.value(field["type"], lines, 1, read)
        return name

    def call_record(self, function: str, lines: list[str], depth: int, expr: str) -> None:
        lines.append(f"{'    ' * depth}{function}(out, {expr})")

    def primitive(self, kind: str, lines: list[str], depth: int, expr: str) -> None:
        pad = "    " * depth
        if kind in ("int", "long"):
            self.long(lines, depth, expr)
        elif kind in ("string", "bytes"):
            data = self.fresh("data")
            lines.append(f"{pad}{data} = {expr}.encode()" if kind == "string" else f"{pad}{data} = bytes({expr})")
            self.long(lines, depth, f"len({data})")
            lines.append(f"{pad}append({data})")
        elif kind == "boolean":
            lines.append(f"{pad}append(b'\\x01' if {expr} else b'\\x00')")
        elif kind in ("float", "double"):
            lines.append(f"{pad}append(pack_{kind}({expr}))")
        else:  # null
            lines.append(f"{pad}check_null({expr})")

    def long(self, lines: list[str], depth: int, expr: str) -> None:
        pad = "    " * depth
        if not expr.isidentifier():
            n = self.fresh("n")
            lines.append(f"{pad}{n} = {expr}")
            expr = n
        lines.append(f"{pad}append(one_byte[{expr} + 64] if -64 <= {expr} < 64 else long_bytes({expr}))")

    def optional(self, branches: list[Any], lines: list[str], depth: int, expr: str) -> None:
        others = [b for b in branches if b != "null"]
        if len(branches) != 2 or len(others) != 1:
            raise NotCompiled(f"union {branches}")
        pad = "    " * depth
        value = self.fresh("x")
        null_byte, other_byte = long_bytes(branches.index("null")), long_bytes(branches.index(others[0]))
        lines += [f"{pad}{value} = {expr}", f"{pad}if {value} is None:", f"{pad}    append({null_byte!r})",
                  f"{pad}else:", f"{pad}    append({other_byte!r})"]
        self.value(others[0], lines, depth + 1, value)

    def enum(self, schema: dict[str, Any], lines: list[str], depth: int, expr: str) -> None:
        index = self.fresh("symbols")
        self.constants[index] = {symbol: long_bytes(i) for i, symbol in enumerate(schema["symbols"])}
        self.constants[f"{index}_name"] = schema["name"]
        pad = "    " * depth
        symbol = self.fresh("symbol")
        lines += [f"{pad}{symbol} = {expr}", f"{pad}if {symbol} not in {index}:",
                  f"{pad}    raise ValueError(f'{{{symbol}!r}} is not a symbol of {{{index}_name}}')",
                  f"{pad}append({index}[{symbol}])"]

    def blocks(self, schema: dict[str, Any], lines: list[str], depth: int, expr: str) -> None:
        """An array or a map: one block of its items, its count first, then the empty block that ends it."""
        is_map = schema["type"] == "map"
        pad = "    " * depth
        items, key, item = self.fresh("items"), self.fresh("key"), self.fresh("item")
        lines += [f"{pad}{items} = {expr}", f"{pad}if {items}:"]
        self.long(lines, depth + 1, f"len({items})")
        if is_map:
            lines.append(f"{pad}    for {key}, {item} in {items}.items():")
            self.value("string", lines, depth + 2, key)
        else:
            lines.append(f"{pad}    for {item} in {items}:")
        self.value(schema["values"] if is_map else schema["items"], lines, depth + 2, item)
        lines.append(f"{pad}append(b'\\x00')")
