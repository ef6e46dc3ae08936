"""Avro codec with Avro single-object encoding, or Confluent's wire format where a schema
registry is configured.

A record on the bus is ``C3 01`` + the 8-byte CRC-64-AVRO fingerprint (little endian) of its
writer schema + the Avro binary body; with a schema registry (registry.py) it is ``00`` + the
4-byte big-endian id the registry gives its writer schema + the same body, which the Kafka
ecosystem's readers take. A reader takes either: it looks the fingerprint up among the schemas it
knows (the current ones in ``avro/`` and every retired version in ``avro/history/``), or the id
among those it has met (fetching a new one's schema from its registry, once), and resolves the
writer schema against its own reader schema, so old records stay readable after a schema evolves.
Records written with a current schema (nearly all) are read and written by code compiled from it
(avro_reader.py, avro_writer.py); fastavro does the rest.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any, TypeVar, cast

import fastavro
from fastavro.schema import fingerprint, parse_schema, to_parsing_canonical_form

from tokenbus.schemas.avro_reader import Reader, compile_reader
from tokenbus.schemas.avro_source import NotCompiled
from tokenbus.schemas.avro_writer import Writer, compile_writer
from tokenbus.schemas.records import RECORD_TYPES, Record
from tokenbus.schemas.registry import SchemaRegistry

SCHEMA_DIR = Path(__file__).parent / "avro"
SINGLE_OBJECT_MAGIC = b"\xc3\x01"
HEADER_SIZE = len(SINGLE_OBJECT_MAGIC) + 8
CONFLUENT_MAGIC = b"\x00"
CONFLUENT_HEADER_SIZE = len(CONFLUENT_MAGIC) + 4

R = TypeVar("R", bound=Record)


class DecodeError(ValueError):
    """The bytes are not a record this codec can read. ``reason`` is a short machine tag."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def schema_fingerprint(parsed_schema: Any) -> bytes:
    canonical = to_parsing_canonical_form(parsed_schema)
    return int(fingerprint(canonical, "CRC-64-AVRO"), 16).to_bytes(8, "little")


def _load_schema_files(folder: Path) -> list[dict[str, Any]]:
    if not folder.is_dir():
        return []
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.avsc"))]


def _writer(parsed_schema: Any) -> Writer:
    """The compiled writer of a schema (avro_writer.py), or fastavro's where it does not compile."""
    try:
        return compile_writer(parsed_schema)
    except NotCompiled:
        def write_with_fastavro(out: list[bytes], datum: Any) -> None:
            body = io.BytesIO()
            fastavro.schemaless_writer(body, parsed_schema, datum)
            out.append(body.getvalue())

        return write_with_fastavro


def _compiled_reader(parsed_schema: Any) -> Reader | None:
    """The compiled reader of a schema (avro_reader.py), or None where fastavro reads it."""
    try:
        return compile_reader(parsed_schema)
    except NotCompiled:
        return None


class AvroCodec:
    """Encodes records with the current schemas and decodes any known schema version. With a
    ``registry``, records are written in Confluent's wire format; call ``register_schemas`` as the
    service starts, so that its first records wait for no registry."""

    def __init__(self, schema_dir: Path = SCHEMA_DIR, registry: SchemaRegistry | None = None) -> None:
        self.registry = registry
        self._raw_schemas: dict[str, dict[str, Any]] = {}  # as the files have them: what is registered
        self._headers: dict[str, bytes] = {}  # each record type's framing, up to its body
        self._writers_by_id: dict[int, Any] = {}  # the registry's ids met so far, and their writer schemas
        self._readers: dict[str, Any] = {}
        self._writers_by_fingerprint: dict[bytes, Any] = {}
        self._writers: dict[str, Writer] = {}
        self._compiled_readers: dict[str, Reader | None] = {}  # for records written with the current schema
        self._reads_objects: set[str] = set()  # record types whose compiled reader returns the record itself
        for raw in _load_schema_files(schema_dir):
            parsed = cast(dict[str, Any], parse_schema(raw))
            name = parsed["name"]
            self._raw_schemas[name] = raw
            self._readers[name] = parsed
            self._writers[name] = _writer(parsed)
            self._compiled_readers[name] = _compiled_reader(parsed)
            # The reader's own parsed schema stands for the current writer: fastavro resolves a
            # writer schema against the reader's on every read unless they are one object (7.9
            # against 5.4 µs for a token event).
            fp = schema_fingerprint(parsed)
            self._writers_by_fingerprint[fp] = parsed
            if registry is None:
                self._headers[name] = SINGLE_OBJECT_MAGIC + fp
        for raw in _load_schema_files(schema_dir / "history"):
            self.register_writer_schema(raw)
        missing = {t.schema_name for t in RECORD_TYPES} - self._readers.keys()
        if missing:
            raise RuntimeError(f"no Avro schema file for {sorted(missing)} in {schema_dir}")
        # A record type whose Avro form is its attributes as they are is written from the object,
        # without the dict ``to_avro`` builds (1.3 of a token event's 4.5 µs to encode), and read
        # into the object, without the dict ``from_avro`` takes apart.
        self._attribute_writers: dict[str, Writer] = {}
        for record_type in RECORD_TYPES:
            if getattr(record_type, "avro_from_attributes", False):
                name = record_type.schema_name
                classes = {t.schema_name: t for t in (record_type, *getattr(record_type, "avro_record_classes", ()))}
                with contextlib.suppress(NotCompiled):
                    self._attribute_writers[name] = compile_writer(self._readers[name], attributes=True)
                with contextlib.suppress(NotCompiled):
                    self._compiled_readers[name] = compile_reader(self._readers[name], classes)
                    self._reads_objects.add(name)

    def register_writer_schema(self, schema: dict[str, Any]) -> bytes:
        """Make records written with ``schema`` (e.g. an older version) readable; returns its fingerprint."""
        parsed = parse_schema(schema)
        fp = schema_fingerprint(parsed)
        self._writers_by_fingerprint.setdefault(fp, parsed)  # a current schema stays its reader's object
        return fp

    def register_schemas(self) -> dict[str, int]:
        """With a registry, the ids of every current schema by subject, registered where the
        registry lacks them (or looked up, without ``auto_register``): a service that cannot reach
        its registry fails here, as it starts, rather than at its first record. Without one, {}."""
        if self.registry is None:
            return {}
        return {name: int.from_bytes(self._header(name)[len(CONFLUENT_MAGIC):], "big") for name in self._readers}

    def _header(self, name: str) -> bytes:
        header = self._headers.get(name)
        if header is None:  # a registry's: asked once
            assert self.registry is not None
            schema_id = self.registry.id_of(name, self._raw_schemas[name])
            self._writers_by_id[schema_id] = self._readers[name]  # its records read compiled, unfetched
            header = self._headers[name] = CONFLUENT_MAGIC + schema_id.to_bytes(4, "big")
        return header

    def schema(self, name: str) -> Any:
        """The current schema of a record type (its full name, e.g. ``tokenbus.TokenEvent``), parsed."""
        return self._readers[name]

    def encode(self, record: Record) -> bytes:
        name = record.schema_name
        out = [self._headers.get(name) or self._header(name)]
        from_attributes = self._attribute_writers.get(name)
        if from_attributes is not None:
            from_attributes(out, record)
        else:
            self._writers[name](out, record.to_avro())
        return b"".join(out)

    def encode_with(self, schema: dict[str, Any], data: dict[str, Any]) -> bytes:
        """Encode a raw dict with an explicit (possibly older) writer schema."""
        parsed = parse_schema(schema)
        out = io.BytesIO()
        out.write(SINGLE_OBJECT_MAGIC)
        out.write(schema_fingerprint(parsed))
        fastavro.schemaless_writer(out, parsed, data)
        return out.getvalue()

    def decode(self, data: bytes | None, record_type: type[R]) -> R:
        """Decode ``data`` as ``record_type``; any problem raises :class:`DecodeError`."""
        writer, start = self._writer_for(data)
        assert data is not None  # _writer_for refused None
        if writer["name"] != record_type.schema_name:
            raise DecodeError("wrong_schema", f"expected {record_type.schema_name}, got {writer['name']}")
        name = record_type.schema_name
        compiled = self._compiled_readers[name]
        payload = self._read_body(data, start, writer, self._readers[name], compiled)
        if name in self._reads_objects and compiled is not None and writer is self._readers[name]:
            return cast(R, payload)  # read straight into the record
        try:
            return cast(R, record_type.from_avro(payload))
        except (TypeError, ValueError, KeyError) as exc:
            raise DecodeError("invalid_record", str(exc)) from exc

    def _writer_for(self, data: bytes | None) -> tuple[Any, int]:
        """The schema ``data`` was written with, and where its body starts."""
        if data and data[0] == CONFLUENT_MAGIC[0]:  # an int compared: no slice made, on every record read
            return self._writer_of_id(data), CONFLUENT_HEADER_SIZE
        if not data or len(data) < HEADER_SIZE:
            raise DecodeError("truncated", f"{len(data or b'')} bytes")
        if data[:2] != SINGLE_OBJECT_MAGIC:
            raise DecodeError("bad_magic", data[:2].hex())
        writer = self._writers_by_fingerprint.get(bytes(data[2:HEADER_SIZE]))
        if writer is None:
            raise DecodeError("unknown_schema", bytes(data[2:HEADER_SIZE]).hex())
        return writer, HEADER_SIZE

    def _writer_of_id(self, data: bytes) -> Any:
        """The writer schema of a record in Confluent's wire format: one met before, or fetched from
        the registry (once an id). A registry that cannot be asked raises ``SchemaRegistryError``:
        the record is fine, so it is not a ``DecodeError`` (which dead-letters it); its reader
        fails as on a broker error and reads it again."""
        if len(data) < CONFLUENT_HEADER_SIZE:
            raise DecodeError("truncated", f"{len(data)} bytes")
        schema_id = int.from_bytes(data[1:CONFLUENT_HEADER_SIZE], "big")
        writer = self._writers_by_id.get(schema_id)
        if writer is not None:
            return writer
        if self.registry is None:
            raise DecodeError("no_schema_registry", f"schema id {schema_id} (Confluent's wire format) and no "
                                                    "registry to look it up (TOKENBUS_SCHEMA_REGISTRY_URL)")
        schema = self.registry.schema(schema_id)
        if schema is None:
            raise DecodeError("unknown_schema", f"schema id {schema_id} is not in {self.registry.url}")
        try:  # a current schema's records are read by its compiled reader
            writer = self._writers_by_fingerprint[self.register_writer_schema(schema)]
        except Exception as exc:  # what the registry holds is no schema fastavro takes
            raise DecodeError("unknown_schema", f"schema id {schema_id}: {exc}") from exc
        self._writers_by_id[schema_id] = writer
        return writer

    @staticmethod
    def _read_body(data: bytes, start: int, writer: Any, reader: Any, compiled: Reader | None) -> Any:
        try:
            if compiled is not None and writer is reader:  # written with the current schema
                payload, end = compiled(data, start)
            else:  # an older writer schema, resolved against the reader's by fastavro
                body = io.BytesIO(data[start:])
                payload = fastavro.schemaless_reader(body, writer, reader)
                end = start + body.tell()
        except Exception as exc:  # malformed bytes raise many types in either reader
            raise DecodeError("corrupt_body", f"{type(exc).__name__}: {exc}") from exc
        if end > len(data):  # a length read past the end
            raise DecodeError("corrupt_body", f"{end - len(data)} bytes missing")
        if end != len(data):
            raise DecodeError("trailing_bytes", f"{len(data) - end} left")
        return payload
