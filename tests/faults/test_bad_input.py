"""Bad input that must never break anything: arbitrary text inside SSE frames, and random
bytes or wrong schemas on every topic a stream processor reads."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenbus.schemas import AvroCodec, ChatRequest, Completion, Control, ControlAction, ModerationDecision, TokenEvent
from tokenbus.schemas.codec import SINGLE_OBJECT_MAGIC
from tokenbus.sse_edge.plumbing.relay import frame
from tokenbus.sse_edge.protocol.completion_bodies import ChunkWriter
from tokenbus.stream_processors.context import ProcessorContext
from tokenbus.stream_processors.settings import ProcessorSettings

TRICKY = st.sampled_from(["\n", "\r", "\r\n", "\n\n", "data: [DONE]\n\n", "id: 9-9\n", "event: error\n", ":", "\u2028",
                          "\x00", "\"", "\\", "}", "</script>"])
CONTENT = st.lists(st.one_of(TRICKY, st.text()), max_size=8).map("".join)


def parse_sse(stream: bytes) -> list[dict[str, str]]:
    """The event-stream parsing rules a browser applies (lines split on CR, LF or CRLF)."""
    events, fields = [], {}
    for line in stream.decode().replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if line == "":
            if fields:
                events.append(fields)
            fields = {}
            continue
        name, _, value = line.partition(":")
        fields[name] = fields.get(name, "") + value.removeprefix(" ")
    return events


@given(content=CONTENT)
@settings(max_examples=300)
def test_any_content_stays_inside_one_sse_event(content):
    writer = ChunkWriter("chatcmpl-x", "m", include_usage=True)
    stream = frame(writer.delta(content, None), "3-17") + frame("[DONE]")
    events = parse_sse(stream)
    assert [e.get("id") for e in events] == ["3-17", None]
    assert json.loads(events[0]["data"])["choices"][0]["delta"].get("content", "") == content
    assert events[1]["data"] == "[DONE]"


CODEC = AvroCodec()
RECORDS = {
    ChatRequest: ChatRequest("r", "m", "standard", [], "t", 0),
    TokenEvent: TokenEvent("r", 0),
    Completion: Completion("r", "m", "standard", "", "stop", 0, 0, 0, 0, 0),
    ModerationDecision: ModerationDecision("r", "input", "allow"),
}
other_schema = st.sampled_from([CODEC.encode(Control("r", ControlAction.CANCEL)), *map(CODEC.encode, RECORDS.values())])
garbage = st.one_of(
    st.binary(max_size=64),
    st.binary(max_size=64).map(lambda body: SINGLE_OBJECT_MAGIC + b"\x00" * 8 + body),
    st.tuples(other_schema, st.binary(max_size=8)).map(lambda t: t[0][:10] + t[1] + t[0][10:]),
    other_schema,
)


def dead_letters(ctx: ProcessorContext) -> float:
    return sum(s.value for s in ctx.metrics.dead_letters.collect()[0].samples if s.name.endswith("_total"))


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.mark.stack
@pytest.mark.parametrize("record_type", list(RECORDS), ids=lambda t: t.__name__)
def test_random_bytes_on_every_input_topic_are_dead_lettered_never_raised(record_type, bus, loop):
    ctx = ProcessorContext(ProcessorSettings(bus=bus))
    handled: list = []
    offsets = iter(range(10**6))

    async def handle(record, message):
        handled.append(record)

    @given(value=garbage)
    @settings(max_examples=60, suppress_health_check=list(HealthCheck))
    def check(value):
        message = SimpleNamespace(topic="t", partition=0, offset=next(offsets), key=b"k", value=value, headers=[])
        before = dead_letters(ctx)
        loop.run_until_complete(ctx.process("fuzz", message, record_type, handle))
        after = dead_letters(ctx)
        decodable = True
        try:
            CODEC.decode(value, record_type)
        except Exception:
            decodable = False
        assert after == before + (0 if decodable else 1)  # either handled or dead-lettered, once

    try:
        check()
    finally:
        loop.run_until_complete(ctx.stop())
