import dataclasses
import json
import os
import random

import pytest

from tokenbus.schemas import (
    AvroCodec,
    CachedPrefix,
    CacheReport,
    ChatMessage,
    ChatRequest,
    Completion,
    Control,
    ControlAction,
    DecodeError,
    ModerationDecision,
    TokenEvent,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    TopLogprob,
)
from tokenbus.schemas.codec import SCHEMA_DIR, SINGLE_OBJECT_MAGIC, schema_fingerprint
from tokenbus.schemas.records import RECORD_TYPES

codec = AvroCodec()


def sample_request(**overrides) -> ChatRequest:
    fields = dict(
        request_id="chatcmpl-1",
        model="m",
        tier="standard",
        messages=[ChatMessage("system", "be brief"), ChatMessage("user", "héllo\ndata: [DONE]")],
        reply_topic="tokenbus.tokens",
        reply_partition=3,
        tenant="acme",
        conversation_id="conv-9",
        max_tokens=12,
        temperature=0.5,
        top_p=0.9,
        seed=42,
        stop=["\n\n"],
        deadline_ms=123,
    )
    return ChatRequest(**{**fields, **overrides})


RECORDS = [
    sample_request(),
    sample_request(conversation_id=None, max_tokens=None, temperature=None, stop=[]),
    TokenEvent("chatcmpl-1", 0, "Hi", [5, 6]),
    TokenEvent("chatcmpl-1", 7, "", [], finish_reason="length", prompt_tokens=3, completion_tokens=7,
               cached_tokens=2),
    Completion("chatcmpl-1", "m", "standard", "Hi there", "stop", 3, 2, 1, 2, 3,
               messages=[ChatMessage("user", "x")], first_token_at_ms=2, cached_prompt_tokens=2),
    sample_request(tools=[ToolSpec("get_weather", "Weather now", '{"type":"object"}'), ToolSpec("noop")],
                   tool_choice="function", tool_choice_name="get_weather", parallel_tool_calls=False,
                   messages=[ChatMessage("user", "weather?"),
                             ChatMessage("assistant", "", (ToolCall("call_1", "get_weather", '{"city":"Oslo"}'),)),
                             ChatMessage("tool", "3 C", tool_call_id="call_1")]),
    TokenEvent("chatcmpl-1", 2, "", [9, 10], tool_calls=[ToolCallDelta(0, "call_1", "f", '{"a"'),
                                                         ToolCallDelta(0, arguments=":1}")],
               raw_text='<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>'),
    Completion("chatcmpl-1", "m", "standard", "", "tool_calls", 3, 9, 1, 2, 3,
               tool_calls=[ToolCall("call_1", "f", '{"a":1}')]),
    TokenEvent("chatcmpl-1", 3, " bus", [11, 12],
               logprobs=[TokenLogprob(" b", -0.5, [TopLogprob(" b", -0.5), TopLogprob(" a", -1.25)]),
                         TokenLogprob("us", -0.0)]),
    sample_request(logprobs=True, top_logprobs=5),
    TokenEvent("cmpl-1", 0, " bus", [11], echo="the  bus\n",
               prompt_logprobs=[TokenLogprob("the", 0.0), TokenLogprob("  bus", -2.5, [TopLogprob(" bus", -0.5)])]),
    sample_request(text_prompt=True, echo=True, logprobs=True, prompt_token_ids=[5, 0, 2**31 - 1]),
    sample_request(response_format="regex", guided_regex="(yes|no)", include_stop_str_in_output=True,
                   continue_final_message=True, add_generation_prompt=False, prompt_billed_with="chatcmpl-1-0",
                   bad_words=["red bus", "x"], prompt_cache_key="agent-7"),
    Control("chatcmpl-1", ControlAction.CANCEL, "client went away"),
    CacheReport("w-1", "m", 1_700_000_000_000, 4, snapshot=True, stored=[CachedPrefix(-(2**63), 64), CachedPrefix(7, 16)],
                removed=[2**63 - 1], partitions=[("tokenbus.requests.m.standard", 2)], running=3, waiting=1),
    CacheReport("w-1", "m", 1_700_000_000_000, 5, leaving=True),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_round_trip(record):
    data = codec.encode(record)
    assert data[:2] == SINGLE_OBJECT_MAGIC
    assert codec.decode(data, type(record)) == record


def test_records_of_the_current_schemas_read_without_schema_resolution():
    """fastavro resolves the writer schema against the reader's on every read unless they are one
    object, a third of a token event's decode (which every edge, consumer and processor does per
    record): a record written with the current schema must find the reader's own schema."""
    for record_type in RECORD_TYPES:
        name = record_type.schema_name
        reader = codec._readers[name]
        assert codec._writers_by_fingerprint[schema_fingerprint(reader)] is reader, name


def test_every_record_has_a_schema_file():
    names = {json.loads(p.read_text())["name"] for p in SCHEMA_DIR.glob("*.avsc")}
    assert names == {"ChatRequest", "TokenEvent", "Completion", "Control", "ModerationDecision", "CacheReport"}


def test_token_events_written_before_moderation_fields_still_read():
    """History keeps v1 of TokenEvent (before truncate, tenant, tier): its records decode with the defaults."""
    codec = AvroCodec()
    v1 = json.loads((SCHEMA_DIR / "history" / "token_event.v1.avsc").read_text())
    data = codec.encode_with(v1, {"request_id": "r", "seq": 3, "text": "hi", "token_ids": [1], "finish_reason": None,
                                  "error": None, "prompt_tokens": None, "completion_tokens": None,
                                  "worker_id": "w", "created_at_ms": 5})
    event = codec.decode(data, TokenEvent)
    assert (event.seq, event.text, event.truncate, event.tenant, event.tier) == (3, "hi", False, None, None)


@pytest.mark.parametrize(("record_type", "version"), [(ChatRequest, "chat_request.v1"),
                                                       (Completion, "completion.v1"),
                                                       (TokenEvent, "token_event.v2")])
def test_records_written_before_tool_calls_still_read(record_type, version):
    """History keeps the versions before tool calls: their records decode with no tools and no calls."""
    codec = AvroCodec()
    old = json.loads((SCHEMA_DIR / "history" / f"{version}.avsc").read_text())
    current = next(r for r in RECORDS if type(r) is record_type)
    fields = {f["name"] for f in old["fields"]}
    data = {k: v for k, v in current.to_avro().items() if k in fields}
    if "messages" in data:
        data["messages"] = [{"role": m["role"], "content": m["content"]} for m in data["messages"]]
    decoded = codec.decode(codec.encode_with(old, data), record_type)
    assert decoded.request_id == current.request_id
    assert getattr(decoded, "tool_calls", []) == [] and getattr(decoded, "tools", []) == []
    assert all(m.tool_calls == () and m.tool_call_id is None for m in getattr(decoded, "messages", []))


HISTORY = {"chat_request": ChatRequest, "completion": Completion, "token_event": TokenEvent}


@pytest.mark.parametrize("path", sorted((SCHEMA_DIR / "history").glob("*.avsc")), ids=lambda p: p.stem)
def test_every_retired_version_still_reads_with_the_defaults_of_what_came_later(path):
    """A record written with any retired schema decodes into today's record: what that version
    had is kept, every field added since takes its default."""
    old = json.loads(path.read_text())
    record_type = HISTORY[path.stem.split(".")[0]]
    current = next(r for r in RECORDS if type(r) is record_type)
    fields = {f["name"]: f for f in old["fields"]}
    data = {k: v for k, v in current.to_avro().items() if k in fields}
    if "messages" in data:
        item = fields["messages"]["type"]["items"]
        message_fields = {f["name"] for f in item["fields"]} if isinstance(item, dict) else {"role", "content"}
        data["messages"] = [{k: v for k, v in m.items() if k in message_fields} for m in data["messages"]]
    decoded = AvroCodec().decode(AvroCodec().encode_with(old, data), record_type)
    assert decoded.request_id == current.request_id
    added = [f for f in dataclasses.fields(record_type) if f.name not in fields]
    assert added, "a retired version lacks something today's has"
    for field in added:
        expected = field.default_factory() if callable(field.default_factory) else field.default
        assert getattr(decoded, field.name) == expected, f"{field.name} of a {path.stem} record"


def test_moderation_decisions_round_trip():
    codec = AvroCodec()
    decision = ModerationDecision("r", "output", "block", tenant="t", tier="interactive", categories=["pii_card"],
                                  scores={"pii_card": 1.0}, seq=12, policy="p@1")
    assert codec.decode(codec.encode(decision), ModerationDecision) == decision


def test_newer_reader_reads_older_record():
    """A v1 ChatRequest (before tenant, key_id, conversation_id, seed, stop, deadline) stays readable."""
    current = json.loads((SCHEMA_DIR / "chat_request.avsc").read_text())
    current = json.loads((SCHEMA_DIR / "history" / "chat_request.v1.avsc").read_text())
    added_later = {"tenant", "key_id", "conversation_id", "seed", "stop", "deadline_ms"}
    v1 = {**current, "fields": [f for f in current["fields"] if f["name"] not in added_later]}
    v1_record = {
        "request_id": "old-1", "model": "m", "tier": "batch",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": None, "temperature": 0.1, "top_p": None,
        "reply_topic": "tokens", "reply_partition": 1, "created_at_ms": 5,
    }
    reader = AvroCodec()
    data = reader.encode_with(v1, v1_record)
    with pytest.raises(DecodeError) as unknown:
        reader.decode(data, ChatRequest)
    assert unknown.value.reason == "unknown_schema"

    reader.register_writer_schema(v1)
    decoded = reader.decode(data, ChatRequest)
    assert decoded.request_id == "old-1" and decoded.temperature == 0.1
    assert decoded.tenant == "" and decoded.stop == [] and decoded.conversation_id is None


def test_unknown_enum_symbol_reads_as_unknown():
    """A newer writer's control action that this reader does not know maps to UNKNOWN."""
    current = json.loads((SCHEMA_DIR / "control.avsc").read_text())
    newer = json.loads(json.dumps(current))
    newer["fields"][1]["type"]["symbols"] = ["CANCEL", "UNKNOWN", "PAUSE"]
    reader = AvroCodec()
    reader.register_writer_schema(newer)
    data = reader.encode_with(newer, {"request_id": "r", "action": "PAUSE", "reason": "", "created_at_ms": 1})
    assert reader.decode(data, Control).action is ControlAction.UNKNOWN


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (None, "truncated"),
        (b"", "truncated"),
        (b"\xc3\x01abc", "truncated"),
        (b"{\"json\": true, \"not\": \"avro\"}", "bad_magic"),
        (SINGLE_OBJECT_MAGIC + b"\x00" * 8 + b"body", "unknown_schema"),
        (b"\x00\x00\x00\x00\x07body", "no_schema_registry"),  # Confluent's framing, and no registry
        (b"\x00\x00\x01", "truncated"),
    ],
)
def test_garbage_raises_typed_error(data, reason):
    with pytest.raises(DecodeError) as exc:
        codec.decode(data, ChatRequest)
    assert exc.value.reason == reason


def test_wrong_record_type_is_rejected():
    with pytest.raises(DecodeError) as exc:
        codec.decode(codec.encode(RECORDS[2]), ChatRequest)
    assert exc.value.reason == "wrong_schema"


def test_corrupt_and_trailing_bodies_are_rejected():
    data = codec.encode(RECORDS[0])
    with pytest.raises(DecodeError) as trailing:
        codec.decode(data + b"\x00", ChatRequest)
    assert trailing.value.reason == "trailing_bytes"
    with pytest.raises(DecodeError) as cut:
        codec.decode(data[:-5], ChatRequest)
    assert cut.value.reason == "corrupt_body"


def test_random_bytes_after_a_valid_header_never_crash():
    header = codec.encode(RECORDS[0])[:10]
    rng = random.Random(1)
    outcomes = set()
    for _ in range(2000):
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
        try:
            codec.decode(header + body, ChatRequest)
            outcomes.add("decoded")
        except DecodeError as exc:
            outcomes.add(exc.reason)
    assert outcomes <= {"decoded", "corrupt_body", "trailing_bytes", "invalid_record"}
    assert "corrupt_body" in outcomes


def test_random_bytes_never_crash():
    for seed in range(500):
        data = os.urandom(random.Random(seed).randrange(0, 80))
        with pytest.raises(DecodeError):
            codec.decode(data, TokenEvent)
