"""What the compiled Avro reader and writer (avro_reader.py, avro_writer.py) share: Python source
written from a parsed schema, a function per record type (a named type can be referred to before
its function is complete, and a record can hold itself), compiled once with ``exec``, as
``dataclasses`` builds a class's ``__init__``."""

from __future__ import annotations

from typing import Any


class NotCompiled(ValueError):
    """The schema uses something these modules do not compile (the codec keeps fastavro for it)."""


def schema_name(schema: Any) -> str:
    """A schema's name, or its type where it has none."""
    return str(schema.get("name", schema.get("type"))) if isinstance(schema, dict) else str(schema)


PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})


class SchemaSource:
    """The source being written for one schema. This class walks the schema (``value``); a
    subclass says what code each kind of value becomes, reading it into a variable or writing an
    expression (``target``), ``depth`` levels of indentation in."""

    role = ""  # "reader" or "writer": names the compiled code in tracebacks

    def __init__(self) -> None:
        self.functions: list[list[str]] = []
        self.records: dict[str, str] = {}  # full name -> its function's name
        self.named: dict[str, Any] = {}  # full name -> its schema (records and enums)
        self.constants: dict[str, Any] = {}  # names the source uses, for its namespace
        self._names = 0

    def value(self, schema: Any, lines: list[str], depth: int, target: str) -> None:
        """Append the code for one ``schema`` value."""
        if isinstance(schema, list):
            return self.optional(schema, lines, depth, target)
        if isinstance(schema, str) and schema in self.records:
            return self.call_record(self.records[schema], lines, depth, target)
        if isinstance(schema, str) and schema in self.named:  # an enum defined earlier
            schema = self.named[schema]
        if isinstance(schema, dict) and "logicalType" in schema:
            raise NotCompiled(f"logical type {schema['logicalType']}")
        kind = schema if isinstance(schema, str) else schema["type"]
        if kind == "record":
            return self.call_record(self.record(schema), lines, depth, target)
        if kind == "enum":
            self.named[schema["name"]] = schema
            return self.enum(schema, lines, depth, target)
        if kind in ("array", "map"):
            return self.blocks(schema, lines, depth, target)
        if kind not in PRIMITIVES:
            raise NotCompiled(f"type {kind!r}")
        return self.primitive(kind, lines, depth, target)

    def new_record(self, schema: dict[str, Any], prefix: str, params: str) -> tuple[str, list[str]]:
        """Start the function of a record type (registered before its fields, which may name it)."""
        name = self.fresh(prefix)
        self.records[schema["name"]] = name
        self.named[schema["name"]] = schema
        lines = [f"def {name}({params}):", f"    # {schema['name']}"]
        self.functions.append(lines)
        return name, lines

    # What a subclass writes for each kind of value.
    def record(self, schema: dict[str, Any]) -> str:
        """Write a record type's function; returns its name."""
        raise NotImplementedError

    def call_record(self, function: str, lines: list[str], depth: int, target: str) -> None:
        raise NotImplementedError

    def optional(self, branches: list[Any], lines: list[str], depth: int, target: str) -> None:
        raise NotImplementedError

    def enum(self, schema: dict[str, Any], lines: list[str], depth: int, target: str) -> None:
        raise NotImplementedError

    def blocks(self, schema: dict[str, Any], lines: list[str], depth: int, target: str) -> None:
        raise NotImplementedError

    def primitive(self, kind: str, lines: list[str], depth: int, target: str) -> None:
        raise NotImplementedError

    def fresh(self, prefix: str) -> str:
        self._names += 1
        return f"{prefix}{self._names}"

    def function_for(self, schema: Any) -> str:
        """Write the function that handles a whole ``schema`` value; returns its name."""
        raise NotImplementedError

    def build(self, schema: Any, helpers: dict[str, Any]) -> Any:
        """The compiled function for ``schema``; ``helpers``: what the written source calls."""
        top = self.function_for(schema)
        text = "\n\n".join("\n".join(lines) for lines in self.functions) + "\n"
        namespace = {**helpers, **self.constants}
        exec(compile(text, f"<avro {self.role} of {schema_name(schema)}>", "exec"), namespace)  # source written above
        return namespace[top]
