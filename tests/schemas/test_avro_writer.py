"""The compiled Avro writer against fastavro's: the same bytes for every schema on the bus, for any
values the schema allows, and fastavro's writer kept for what it does not compile."""

import io
import json

import fastavro
import pytest
from fastavro.schema import parse_schema
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbus.schemas import ChatMessage, ChatRequest, Completion, TokenEvent, ToolCall, ToolSpec
from tokenbus.schemas.avro_source import NotCompiled
from tokenbus.schemas.avro_writer import compile_writer, long_bytes
from tokenbus.schemas.codec import HEADER_SIZE, SCHEMA_DIR, AvroCodec, _writer
from tokenbus.schemas.records import ToolCallDelta

SCHEMAS = {p.stem: parse_schema(json.loads(p.read_text())) for p in sorted(SCHEMA_DIR.glob("*.avsc"))}


def datums(schema, named=None):
    """Any value ``schema`` allows (fastavro's parsed form)."""
    named = {} if named is None else named
    if isinstance(schema, str):
        if schema in named:
            return st.deferred(lambda: named[schema])
        schema = {"type": schema}
    if isinstance(schema, list):
        return st.one_of(*(datums(b, named) for b in schema))
    kind = schema["type"]
    if kind == "record":
        strategy = st.fixed_dictionaries({})  # replaced below; a recursive record refers to itself
        named[schema["name"]] = st.deferred(lambda: strategy)
        strategy = st.fixed_dictionaries({f["name"]: datums(f["type"], named) for f in schema["fields"]})
        return strategy
    if kind == "enum":
        return st.sampled_from(schema["symbols"])
    if kind == "array":
        return st.lists(datums(schema["items"], named), max_size=4)
    if kind == "map":
        return st.dictionaries(st.text(max_size=8), datums(schema["values"], named), max_size=4)
    return {
        "null": st.none(), "boolean": st.booleans(), "string": st.text(), "bytes": st.binary(),
        "int": st.integers(-(2**31), 2**31 - 1), "long": st.integers(-(2**63), 2**63 - 1),
        "float": st.floats(width=32, allow_nan=False), "double": st.floats(allow_nan=False),
    }[kind]


def fastavro_bytes(schema, datum) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, schema, datum)
    return out.getvalue()


def compiled_bytes(schema, datum) -> bytes:
    out: list[bytes] = []
    compile_writer(schema)(out, datum)
    return b"".join(out)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@settings(max_examples=150)
@given(data=st.data())
def test_every_bus_schema_compiles_to_fastavros_bytes(name, data):
    schema = SCHEMAS[name]
    datum = data.draw(datums(schema))
    assert compiled_bytes(schema, datum) == fastavro_bytes(schema, datum)


@given(st.integers(-(2**63), 2**63 - 1))
def test_longs_are_fastavros_zigzag_varints(n):
    schema = parse_schema({"type": "record", "name": "N", "fields": [{"name": "n", "type": "long"}]})
    assert long_bytes(n) == fastavro_bytes(schema, {"n": n})


@pytest.mark.parametrize("n", [63, 64, 8191, 8192, 0xFFFFF, 0x100000, -64, -65, 2**63 - 1, -(2**63)])
def test_longs_at_the_edges_of_one_two_and_three_bytes(n):
    schema = parse_schema({"type": "record", "name": "N", "fields": [{"name": "n", "type": "long"}]})
    assert long_bytes(n) == fastavro_bytes(schema, {"n": n})


def test_a_recursive_record():
    schema = parse_schema({"type": "record", "name": "Node", "fields": [
        {"name": "value", "type": "int"}, {"name": "next", "type": ["null", "Node"]}]})
    datum = {"value": 1, "next": {"value": -2, "next": {"value": 300, "next": None}}}
    assert compiled_bytes(schema, datum) == fastavro_bytes(schema, datum)


@pytest.mark.parametrize("schema", [
    ["int", "string"],  # a union of two non-null types: fastavro picks the branch by the value
    {"type": "fixed", "name": "F", "size": 4},
    {"type": "long", "logicalType": "timestamp-millis"},
])
def test_what_it_does_not_compile_fastavro_writes(schema):
    record = parse_schema({"type": "record", "name": "R", "fields": [{"name": "x", "type": schema}]})
    datum = {"x": b"abcd" if isinstance(schema, dict) and schema["type"] == "fixed" else 7}
    with pytest.raises(NotCompiled):
        compile_writer(record)
    out: list[bytes] = []
    _writer(record)(out, datum)
    assert b"".join(out) == fastavro_bytes(record, datum)


def test_a_wrong_value_raises_rather_than_writing_a_record():
    with pytest.raises((TypeError, AttributeError, ValueError)):
        compiled_bytes(SCHEMAS["control"], {"request_id": None, "action": "CANCEL", "reason": "", "created_at_ms": 1})
    with pytest.raises(ValueError):
        compiled_bytes(SCHEMAS["control"], {"request_id": "r", "action": "EXPLODE", "reason": "", "created_at_ms": 1})


def test_the_codec_writes_every_current_schema_compiled():
    codec = AvroCodec()
    assert all(w.__code__.co_filename.startswith("<avro writer of") for w in codec._writers.values())


CODEC = AvroCodec()


def optional(strategy):
    return st.none() | strategy


token_events = st.builds(
    TokenEvent, request_id=st.text(), seq=st.integers(0, 2**31 - 1), text=st.text(),
    token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=4),
    tool_calls=st.lists(st.builds(ToolCallDelta, index=st.integers(0, 2**31 - 1), id=optional(st.text()),
                                  name=optional(st.text()), arguments=st.text()), max_size=3),
    raw_text=optional(st.text()), finish_reason=optional(st.text()), error=optional(st.text()),
    prompt_tokens=optional(st.integers(0, 2**31 - 1)), completion_tokens=optional(st.integers(0, 2**31 - 1)),
    worker_id=st.text(), created_at_ms=st.integers(0, 2**63 - 1), truncate=st.booleans(),
    tenant=optional(st.text()), tier=optional(st.text()), admitted_at_ms=optional(st.integers(0, 2**63 - 1)),
    cached_tokens=optional(st.integers(0, 2**31 - 1)))


@settings(max_examples=300)
@given(token_events)
def test_a_token_event_written_from_its_attributes_is_what_its_dict_gives(event):
    """A token event (one per token of every sequence) is written from its attributes, not from
    the dict ``to_avro`` builds; the bytes are fastavro's of that dict."""
    assert TokenEvent.schema_name in CODEC._attribute_writers
    assert CODEC.encode(event)[HEADER_SIZE:] == fastavro_bytes(SCHEMAS["token_event"], event.to_avro())
    assert CODEC.decode(CODEC.encode(event), TokenEvent) == event


texts = st.text(max_size=12)
ints, longs = st.integers(-(2**31), 2**31 - 1), st.integers(-(2**63), 2**63 - 1)
tool_calls = st.builds(ToolCall, id=texts, name=texts, arguments=texts)
messages = st.builds(ChatMessage, role=texts, content=texts, tool_calls=st.lists(tool_calls, max_size=2).map(tuple),
                     tool_call_id=optional(texts))
requests = st.builds(
    ChatRequest, request_id=texts, model=texts, tier=texts, messages=st.lists(messages, max_size=3),
    reply_topic=texts, reply_partition=ints, tenant=texts, key_id=texts, conversation_id=optional(texts),
    max_tokens=optional(ints), temperature=optional(st.floats(allow_nan=False)),
    top_p=optional(st.floats(allow_nan=False)), seed=optional(longs), stop=st.lists(texts, max_size=2),
    created_at_ms=longs, deadline_ms=optional(longs),
    tools=st.lists(st.builds(ToolSpec, name=texts, description=texts, parameters=texts), max_size=2),
    tool_choice=texts, tool_choice_name=optional(texts), parallel_tool_calls=st.booleans(),
    continues_request_id=optional(texts), continues_turn_at_ms=optional(longs),
    prefix_token_ids=st.lists(ints, max_size=4), prefix_text=texts,
    annotations=st.dictionaries(texts, texts, max_size=2))
completions = st.builds(
    Completion, request_id=texts, model=texts, tier=texts, text=texts, finish_reason=texts, prompt_tokens=ints,
    completion_tokens=ints, created_at_ms=longs, started_at_ms=longs, finished_at_ms=longs, tenant=texts,
    key_id=texts, conversation_id=optional(texts), messages=st.lists(messages, max_size=3), cancelled=st.booleans(),
    error=optional(texts), worker_id=texts, first_token_at_ms=optional(longs),
    tool_calls=st.lists(tool_calls, max_size=2), continues_request_id=optional(texts),
    continues_turn_at_ms=optional(longs), carried_tokens=ints, annotations=st.dictionaries(texts, texts, max_size=2),
    cached_prompt_tokens=ints)


@settings(max_examples=200)
@given(st.one_of(requests, completions))
def test_requests_and_completions_written_from_their_attributes_are_what_their_dicts_give(record):
    """A request (an edge writes one a request, a GPU consumer reads it) and a completion are written
    from their attributes and read into their classes: the bytes are fastavro's of ``to_avro``'s
    dict, and a message read back keeps its calls as the tuple its frozen class holds."""
    assert record.schema_name in CODEC._attribute_writers
    schema = SCHEMAS["chat_request" if isinstance(record, ChatRequest) else "completion"]
    written = CODEC.encode(record)
    assert written[HEADER_SIZE:] == fastavro_bytes(schema, record.to_avro())
    read = CODEC.decode(written, type(record))
    assert read == record
    assert all(type(m.tool_calls) is tuple for m in read.messages)
    hash(tuple(read.messages))
