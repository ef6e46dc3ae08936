"""The compiled Avro reader against fastavro's: the same values from every schema on the bus, for
any values the schema allows; malformed bytes refused rather than misread; fastavro's reader kept
for what it does not compile; records read straight into their classes where it is given them."""

import io
import random

import fastavro
import pytest
from fastavro.schema import parse_schema
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.schemas.test_avro_writer import SCHEMAS, datums, fastavro_bytes
from tokenbus.schemas import AvroCodec, Control, ControlAction, TokenEvent, TokenLogprob, ToolCallDelta, TopLogprob
from tokenbus.schemas.avro_reader import compile_reader, long_at
from tokenbus.schemas.avro_source import NotCompiled
from tokenbus.schemas.codec import HEADER_SIZE, DecodeError


def fastavro_value(schema, data: bytes):
    return fastavro.schemaless_reader(io.BytesIO(data), schema, None)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@settings(max_examples=150)
@given(data=st.data())
def test_every_bus_schema_reads_as_fastavro_reads_it(name, data):
    schema = SCHEMAS[name]
    written = fastavro_bytes(schema, data.draw(datums(schema)))
    value, end = compile_reader(schema)(written, 0)
    assert end == len(written)
    assert value == fastavro_value(schema, written)


@given(st.integers(-(2**63), 2**63 - 1))
def test_longs_of_every_length(n):
    schema = parse_schema({"type": "record", "name": "N", "fields": [{"name": "n", "type": "long"}]})
    written = fastavro_bytes(schema, {"n": n})
    assert long_at(written, 0) == (n, len(written))
    assert compile_reader(schema)(written, 0) == ({"n": n}, len(written))


@settings(max_examples=100)
@given(data=st.data())
def test_token_events_read_into_their_classes_as_their_dicts_make_them(data):
    schema = SCHEMAS["token_event"]
    written = fastavro_bytes(schema, data.draw(datums(schema)))
    classes = {t.schema_name: t for t in (TokenEvent, *TokenEvent.avro_record_classes)}
    event, end = compile_reader(schema, classes)(written, 0)
    assert end == len(written)
    assert type(event) is TokenEvent and all(type(d) is ToolCallDelta for d in event.tool_calls)
    assert all(type(t) is TokenLogprob and all(type(a) is TopLogprob for a in t.top) for t in event.logprobs)
    assert event == TokenEvent.from_avro(fastavro_value(schema, written))


class Point:
    """No dataclass: its fields are passed by name."""

    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y


def test_a_class_that_is_no_dataclass_gets_the_fields_by_name():
    schema = parse_schema({"type": "record", "name": "Point", "fields": [
        {"name": "y", "type": "int"}, {"name": "x", "type": "int"}]})
    point, _ = compile_reader(schema, {"Point": Point})(fastavro_bytes(schema, {"y": 2, "x": 1}), 0)
    assert (type(point), point.x, point.y) == (Point, 1, 2)
    reserved = parse_schema({"type": "record", "name": "Point", "fields": [{"name": "class", "type": "int"}]})
    with pytest.raises(NotCompiled):
        compile_reader(reserved, {"Point": Point})
    assert compile_reader(reserved)(fastavro_bytes(reserved, {"class": 3}), 0) == ({"class": 3}, 1)


class Pair:
    """Annotated with a name its module does not define: which fields are tuples cannot be told."""

    def __init__(self, left: int, right: int) -> None:
        self.left, self.right = left, right

    __annotations__ = {"left": "int", "right": "Undefined"}


def test_a_class_whose_annotations_do_not_resolve_is_read_into_a_dict():
    schema = parse_schema({"type": "record", "name": "Pair", "fields": [
        {"name": "left", "type": "int"}, {"name": "right", "type": "int"}]})
    with pytest.raises(NotCompiled):
        compile_reader(schema, {"Pair": Pair})
    assert compile_reader(schema)(fastavro_bytes(schema, {"left": 1, "right": 2}), 0) == ({"left": 1, "right": 2}, 2)


def test_a_recursive_record_and_a_union_with_null_second():
    schema = parse_schema({"type": "record", "name": "Node", "fields": [
        {"name": "value", "type": "int"}, {"name": "next", "type": ["Node", "null"]},
        {"name": "children", "type": {"type": "array", "items": "Node"}}]})
    datum = {"value": 1, "next": {"value": -2, "next": None, "children": []},
             "children": [{"value": 300, "next": None, "children": []}]}
    written = fastavro_bytes(schema, datum)
    assert compile_reader(schema)(written, 0) == (datum, len(written))


def test_blocks_written_with_their_size_in_bytes():
    """Avro lets a writer give a block's size after a negative count (fastavro never does)."""
    schema = parse_schema({"type": "record", "name": "R", "fields": [
        {"name": "xs", "type": {"type": "array", "items": "int"}},
        {"name": "m", "type": {"type": "map", "values": "string"}}]})
    xs = b"\x03" + b"\x04" + b"\x02\x04"  # count -2, size 2 bytes, items 1 and 2
    m = b"\x01" + b"\x08" + b"\x02k\x04vv"  # count -1, size 4 bytes, "k": "vv"
    written = xs + b"\x00" + m + b"\x00"
    assert compile_reader(schema)(written, 0) == ({"xs": [1, 2], "m": {"k": "vv"}}, len(written))


@pytest.mark.parametrize(("schema", "body", "error"), [
    ({"type": "enum", "name": "E", "symbols": ["A", "B"]}, b"\x04", "enum index 2"),  # index 2 of two
    ({"type": "enum", "name": "E", "symbols": ["A", "B"]}, b"\x01", "enum index -1"),
    (["null", "string"], b"\x04", "union branch 4"),
    ("string", b"\x03ab", "negative length"),
    ({"type": "array", "items": "long"}, b"\xfe\xff\xff\xff\x0f", "block longer than the data"),
])
def test_malformed_bytes_are_refused(schema, body, error):
    record = parse_schema({"type": "record", "name": "R", "fields": [{"name": "x", "type": schema}]})
    with pytest.raises(ValueError, match=error):
        compile_reader(record)(body, 0)


def test_corrupted_token_events_never_read_as_anything_but_an_error_or_fastavros_value():
    codec, rng = AvroCodec(), random.Random(7)
    schema = SCHEMAS["token_event"]
    read = compile_reader(schema)
    good = codec.encode(TokenEvent("r-1", 3, "héllo", [1, 2, 300], worker_id="w"))[HEADER_SIZE:]
    refused = 0
    for _ in range(3000):
        bad = bytearray(good)
        for _ in range(rng.randrange(1, 4)):
            bad[rng.randrange(len(bad))] = rng.randrange(256)
        bad = bytes(bad[: rng.randrange(len(bad) + 1)] if rng.random() < 0.3 else bad)
        try:
            value, end = read(bad, 0)
        except (ValueError, IndexError):  # UnicodeDecodeError is a ValueError
            refused += 1
            continue
        if end == len(bad):  # what the codec accepts, fastavro reads the same
            assert value == fastavro_value(schema, bad)
    assert refused > 0


def test_a_cut_record_is_a_decode_error():
    codec = AvroCodec()
    data = codec.encode(Control("request-1", ControlAction.CANCEL, "the client left"))
    for cut in range(HEADER_SIZE, len(data)):
        with pytest.raises(DecodeError) as refused:
            codec.decode(data[:cut], Control)
        assert refused.value.reason == "corrupt_body"


@pytest.mark.parametrize("schema", [
    ["int", "string"],
    {"type": "fixed", "name": "F", "size": 4},
    {"type": "long", "logicalType": "timestamp-millis"},
    {"type": "array", "items": "null"},
    {"type": "map", "values": {"type": "record", "name": "Empty", "fields": []}},
])
def test_what_it_does_not_compile(schema):
    record = parse_schema({"type": "record", "name": "R", "fields": [{"name": "x", "type": schema}]})
    with pytest.raises(NotCompiled):
        compile_reader(record)


def test_the_codec_reads_every_current_schema_compiled():
    readers = AvroCodec()._compiled_readers.values()
    assert all(r is not None and r.__code__.co_filename.startswith("<avro reader of") for r in readers)
