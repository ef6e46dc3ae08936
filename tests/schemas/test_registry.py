"""Confluent's wire format with a schema registry: records framed with the registry's ids, read
back by other processes (each id fetched once), older versions resolved, both framings read, and
ClickHouse's own ``AvroConfluent`` reader taking the records as written. The registry is the fake
in tests/fakes/schema_registry.py (none can be installed here); the last test runs the client
against a real one where ``TOKENBUS_SCHEMA_REGISTRY_URL`` names it."""

import dataclasses
import io
import json
import os
import uuid

import chdb
import fastavro
import pytest

from tests.fakes.schema_registry import FakeSchemaRegistry
from tokenbus.schemas import AvroCodec, ChatMessage, ChatRequest, Completion, DecodeError, TokenEvent, ToolCall
from tokenbus.schemas.codec import CONFLUENT_HEADER_SIZE, HEADER_SIZE, SCHEMA_DIR
from tokenbus.schemas.records import RECORD_TYPES
from tokenbus.schemas.registry import SchemaRegistry, SchemaRegistryError
from tokenbus.topics import BusSettings, make_codec

EVENT = TokenEvent("req-1", 3, " bus", [17], worker_id="w-1", created_at_ms=1_795_000_000_000)
REQUEST = ChatRequest("req-2", "m", "standard", [ChatMessage("user", "hi"),
                      ChatMessage("assistant", "", (ToolCall("c1", "f", "{}"),))], "tokens", 3)


@pytest.fixture
def registry():
    with FakeSchemaRegistry() as fake:
        yield fake


def codec_of(url: str, **options) -> AvroCodec:
    return AvroCodec(registry=SchemaRegistry(url, **options))


def test_records_go_out_in_confluents_wire_format_under_their_record_names(registry):
    codec = make_codec(BusSettings(schema_registry_url=registry.url))
    subjects = {t.schema_name for t in RECORD_TYPES}
    assert {subject for method, subject in registry.requests} == {f"/subjects/{s}/versions" for s in subjects}
    plain = AvroCodec()
    for record in (EVENT, REQUEST):
        written = codec.encode(record)
        assert written[:CONFLUENT_HEADER_SIZE] == b"\x00" + registry.latest_id(record.schema_name).to_bytes(4, "big")
        assert written[CONFLUENT_HEADER_SIZE:] == plain.encode(record)[HEADER_SIZE:]  # the same Avro body
        assert codec.decode(written, type(record)) == record


def test_another_process_fetches_an_id_it_has_not_met_once(registry):
    writer, reader = make_codec(BusSettings(schema_registry_url=registry.url)), codec_of(registry.url)
    events = [writer.encode(TokenEvent("req-1", seq, f" {seq}", [seq])) for seq in range(50)]
    assert [reader.decode(e, TokenEvent).seq for e in events] == list(range(50))
    assert len(registry.ids_asked_for()) == 1
    assert reader.decode(writer.encode(REQUEST), ChatRequest) == REQUEST
    assert len(registry.ids_asked_for()) == 2


def test_a_record_an_older_writer_registered_is_resolved_against_the_current_schema(registry):
    old = json.loads((SCHEMA_DIR / "history" / "token_event.v1.avsc").read_text())
    old_id = registry.register("tokenbus.TokenEvent", old)
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(old), {
        "request_id": "req-9", "seq": 2, "text": " old", "token_ids": [5], "finish_reason": None, "error": None,
        "prompt_tokens": None, "completion_tokens": None, "worker_id": "w-0", "created_at_ms": 7})
    event = codec_of(registry.url).decode(b"\x00" + old_id.to_bytes(4, "big") + body.getvalue(), TokenEvent)
    assert (event.request_id, event.seq, event.text, event.token_ids) == ("req-9", 2, " old", [5])
    assert event.tool_calls == [] and event.cached_tokens is None  # fields added since: their defaults


def test_records_from_before_the_registry_are_read_beside_its_own(registry):
    before, after = AvroCodec().encode(EVENT), make_codec(BusSettings(schema_registry_url=registry.url)).encode(EVENT)
    reader = codec_of(registry.url)
    assert reader.decode(before, TokenEvent) == reader.decode(after, TokenEvent) == EVENT


def test_a_reader_without_a_registry_says_which_setting_it_lacks(registry):
    written = make_codec(BusSettings(schema_registry_url=registry.url)).encode(EVENT)
    with pytest.raises(DecodeError) as refused:
        AvroCodec().decode(written, TokenEvent)
    assert refused.value.reason == "no_schema_registry" and "TOKENBUS_SCHEMA_REGISTRY_URL" in str(refused.value)


def test_an_id_the_registry_does_not_have_is_an_unknown_schema_and_a_cut_header_is_truncated(registry):
    with pytest.raises(DecodeError) as unknown:
        codec_of(registry.url).decode(b"\x00\x00\x00\x03\xe7" + b"\x02", TokenEvent)
    assert unknown.value.reason == "unknown_schema"
    with pytest.raises(DecodeError) as cut:
        codec_of(registry.url).decode(b"\x00\x00\x01", TokenEvent)
    assert cut.value.reason == "truncated"


def test_an_unreachable_registry_fails_the_read_and_the_start_not_the_record(registry):
    written = make_codec(BusSettings(schema_registry_url=registry.url)).encode(EVENT)
    registry.stop()
    with pytest.raises(SchemaRegistryError):  # not a DecodeError: the record is not dead-lettered
        codec_of(registry.url, timeout_s=1).decode(written, TokenEvent)
    with pytest.raises(SchemaRegistryError):
        make_codec(BusSettings(schema_registry_url=registry.url))


def test_without_auto_registration_the_ids_are_looked_up(registry):
    settings = BusSettings(schema_registry_url=registry.url, schema_registry_auto_register=False)
    with pytest.raises(SchemaRegistryError) as missing:
        make_codec(settings)
    assert (missing.value.status, missing.value.error_code) == (404, 40401)
    registered = make_codec(BusSettings(schema_registry_url=registry.url)).encode(EVENT)
    calls = len(registry.requests)
    assert make_codec(settings).encode(EVENT) == registered
    assert all(not path.endswith("/versions") for _, path in registry.requests[calls:])


def test_a_refused_schema_says_why_and_credentials_go_as_basic_auth():
    with FakeSchemaRegistry(credentials=("svc", "s3cret")) as registry:
        with pytest.raises(SchemaRegistryError) as anonymous:
            make_codec(BusSettings(schema_registry_url=registry.url))
        assert anonymous.value.status == 401
        authed = registry.url.replace("http://", "http://svc:s3cret@")
        registry.refuse_next()
        with pytest.raises(SchemaRegistryError) as refused:
            make_codec(BusSettings(schema_registry_url=authed))
        assert refused.value.error_code == 409 and "incompatible" in str(refused.value)
        assert make_codec(BusSettings(schema_registry_url=authed)).decode(
            make_codec(BusSettings(schema_registry_url=authed)).encode(EVENT), TokenEvent) == EVENT


def test_clickhouse_reads_the_completions_as_the_bus_carries_them(registry, tmp_path):
    """ClickHouse's own Avro reader (chDB), given the registry's address, takes the records as
    written: an analyst's ``AvroConfluent`` table or Kafka engine reads the bus directly."""
    codec = make_codec(BusSettings(schema_registry_url=registry.url))
    turn = dataclasses.replace(REQUEST, annotations={"purpose": "chat"})
    completions = [Completion.for_request(turn, text=f"answer {i} — ok", finish_reason="stop", prompt_tokens=12 + i,
                                          completion_tokens=i, started_at_ms=1, finished_at_ms=2 + i, worker_id="w-1")
                   for i in range(3)]
    path = tmp_path / "completions.bin"
    path.write_bytes(b"".join(codec.encode(c) for c in completions))
    rows = chdb.query(f"SELECT request_id, text, prompt_tokens, completion_tokens, annotations['purpose'] "
                      f"FROM file('{path}', 'AvroConfluent') "
                      f"SETTINGS format_avro_schema_registry_url='{registry.url}'", "JSONCompact")
    assert json.loads(rows.bytes())["data"] == [["req-2", f"answer {i} — ok", 12 + i, i, "chat"] for i in range(3)]


@pytest.mark.skipif(not os.environ.get("TOKENBUS_SCHEMA_REGISTRY_URL"),
                    reason="runs where TOKENBUS_SCHEMA_REGISTRY_URL names a schema registry")
def test_against_a_real_registry():
    url = os.environ["TOKENBUS_SCHEMA_REGISTRY_URL"]
    writer, reader = make_codec(BusSettings(schema_registry_url=url)), codec_of(url)
    event = TokenEvent(f"req-{uuid.uuid4().hex}", 0, "hi", [1])
    for record in (event, REQUEST):
        written = writer.encode(record)
        assert written[:1] == b"\x00"
        assert reader.decode(written, type(record)) == record
    lookup = make_codec(BusSettings(schema_registry_url=url, schema_registry_auto_register=False))
    assert lookup.encode(event) == writer.encode(event)
