"""Relaying: the two stream formats (data lines only, or with event ids for SSE clients), resuming
by a count of chunks, releasing what a stream holds when a client leaves early (the event source,
as a replay holds a Kafka consumer, and the request's entry in the reply router), and a live
stream's events written as they arrive, in order, when a write must wait or fails."""

import asyncio
import json
import math
from types import SimpleNamespace

import pytest

from tokenbus.producers import TokenbusClient
from tokenbus.schemas import TokenEvent, TokenLogprob, TopLogprob
from tokenbus.sse_edge.api.chat import live_events
from tokenbus.sse_edge.plumbing.metrics import EdgeMetrics
from tokenbus.sse_edge.plumbing.relay import RelayHooks, frame, generation_error, sse_frames
from tokenbus.sse_edge.plumbing.stream_response import DirectWrites, StreamFormat, sse_response
from tokenbus.sse_edge.protocol.completion_bodies import ChunkWriter
from tokenbus.sse_edge.protocol.logprobs import TextLogprobs, chat_logprobs, chat_logprobs_json
from tokenbus.topics import BusSettings, ReplyEvent, ReplyStream


async def test_a_client_leaving_closes_the_event_source_and_reports_abandonment():
    closed, abandoned = [], []

    async def events():
        try:
            for seq in range(100):
                yield ReplyEvent(TokenEvent("r", seq, f"t{seq}"), 0, seq)
        finally:
            closed.append(True)

    class Hooks(RelayHooks):
        async def on_final(self, event):
            raise AssertionError("the stream never finished")

        def on_abandoned(self):
            abandoned.append(1)

    frames = sse_frames(events(), ChunkWriter("r", "m", False), Hooks(), EdgeMetrics(), started=0.0,
                        stream_format=StreamFormat())
    first = await anext(frames)  # the role chunk goes out with the first event's
    assert b"assistant" in first and b'"t0"' in first
    assert b'"t1"' in await anext(frames)
    await frames.aclose()  # what the server does when the client disconnects
    assert closed == [True] and abandoned == [1]


async def test_a_closed_live_stream_leaves_the_router():
    bus = TokenbusClient(BusSettings(), reply_partitions=[0])  # never started: nothing here needs the broker
    stream = bus.router.open("r")
    stream.offer(ReplyEvent(TokenEvent("r", 0, "first"), 0, 10))
    edge = SimpleNamespace(settings=SimpleNamespace(stream_idle_timeout_s=5), bus=bus)
    events = live_events(edge, stream)
    assert (await anext(events)).event.text == "first"
    assert bus.router.open_streams == 1
    await events.aclose()
    assert bus.router.open_streams == 0


def finished_events(texts: list[str]):
    async def events():
        for seq, text in enumerate(texts):
            yield ReplyEvent(TokenEvent("r", seq, text), 0, 40 + seq)
        yield ReplyEvent(TokenEvent("r", len(texts), "", finish_reason="stop", prompt_tokens=3,
                                    completion_tokens=len(texts)), 0, 40 + len(texts))
    return events()


# Every stream here has the same ``created``: streams written apart, maybe a second apart, are compared.
CREATED = 1_795_000_000


async def stream_bytes(stream_format: StreamFormat, texts: list[str], send_role: bool = True) -> bytes:
    frames = sse_frames(finished_events(texts), ChunkWriter("r", "m", include_usage=True, created=CREATED),
                        RelayHooks(), EdgeMetrics(), 0.0, stream_format, send_role)
    return b"".join([f async for f in frames])


def naive_parse(raw: bytes) -> list[dict]:
    """How many tools read a stream: skip blank lines, strip ``data: ``, parse JSON until [DONE]."""
    chunks = []
    for line in raw.decode().splitlines():
        if not line:
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return chunks
        chunks.append(json.loads(data))
    raise AssertionError("no [DONE]")


async def test_the_default_stream_is_data_lines_only():
    raw = await stream_bytes(StreamFormat(), ["a", "b", "c"])
    assert {line.split(b":")[0] for line in raw.splitlines() if line} == {b"data"}
    chunks = naive_parse(raw)
    assert [c["choices"][0]["delta"].get("content") for c in chunks[:-1]] == ["", "a", "b", "c", None]
    assert chunks[-1]["usage"]["completion_tokens"] == 3


async def test_sse_clients_get_each_event_id_and_the_same_data():
    plain = await stream_bytes(StreamFormat(), ["a", "b"])
    with_ids = await stream_bytes(StreamFormat(event_ids=True), ["a", "b"])
    assert [line for line in with_ids.splitlines() if line.startswith(b"id: ")] == [b"id: 0-40", b"id: 0-41",
                                                                                    b"id: 0-42"]
    assert [line for line in with_ids.splitlines() if not line.startswith(b"id: ")] == plain.splitlines()


@pytest.mark.parametrize("received", range(0, 7))
async def test_resuming_after_n_chunks_sends_exactly_the_rest(received):
    whole = naive_parse(await stream_bytes(StreamFormat(), ["a", "b", "c"]))
    rest = naive_parse(await stream_bytes(StreamFormat(skip_chunks=received), ["a", "b", "c"]))
    assert whole[:received] + rest == whole


async def test_each_write_carries_a_whole_event_and_the_last_ends_the_body():
    """A socket write per event, not per frame: the role chunk with the first token's, the usage
    chunk and ``[DONE]`` with the end of the body (a short turn took six writes, now three)."""
    frames = sse_frames(finished_events(["a", "b"]), ChunkWriter("r", "m", include_usage=True),
                        RelayHooks(), EdgeMetrics(), 0.0, StreamFormat())
    messages = []

    async def send(message):
        messages.append(message)

    async def receive():
        await asyncio.Event().wait()  # the client stays

    scope = {"type": "http", "method": "POST", "headers": []}
    await sse_response(frames, heartbeat_s=0, stream_format=StreamFormat())(scope, receive, send)
    bodies = [m for m in messages if m["type"] == "http.response.body"]
    assert [m["more_body"] for m in bodies] == [True, True, True, False]
    written = [naive_parse(m["body"] + b"data: [DONE]\n\n") for m in bodies[:3]]
    assert [[c["choices"][0]["delta"] for c in chunks] for chunks in written] == [
        [{"role": "assistant", "content": ""}, {"content": "a"}], [{"content": "b"}], [{}]]
    assert written[2][0]["choices"][0]["finish_reason"] == "stop"
    assert bodies[3]["body"].endswith(b"data: [DONE]\n\n") and b'"usage"' in bodies[3]["body"]


class LiveTurn:
    """A live stream as the edge relays it (its frames' generator, the response, ``DirectWrites``),
    fed by offers as the reply router makes them; ``send`` is the ASGI server's."""

    def __init__(self, send) -> None:
        self.stream = ReplyStream("r")
        direct = DirectWrites(self.stream)

        async def events():
            async for reply in self.stream.events(idle_timeout=5):
                yield reply

        frames = sse_frames(events(), ChunkWriter("r", "m", include_usage=True, created=CREATED), RelayHooks(),
                            EdgeMetrics(), 0.0, StreamFormat(), direct=direct)
        response = sse_response(frames, heartbeat_s=0, stream_format=StreamFormat(), direct=direct)

        async def receive():
            await asyncio.Event().wait()  # the client stays

        self.task = asyncio.create_task(response({"type": "http", "method": "POST", "headers": []}, receive, send))

    def offer(self, seq: int, text: str = "", final: bool = False) -> None:
        event = TokenEvent("r", seq, text, finish_reason="stop", prompt_tokens=3, completion_tokens=seq) if final \
            else TokenEvent("r", seq, text)
        self.stream.offer(ReplyEvent(event, 0, 40 + seq))


def bodies_of(messages: list[dict]) -> list[bytes]:
    return [m["body"] for m in messages if m["type"] == "http.response.body"]


async def test_a_live_streams_events_after_the_first_are_written_as_they_arrive():
    """After the first event, each event is written in the reply router's call that offers it (no
    wake-up of the stream's task), and the client gets exactly the bytes a stream written by its
    task would have carried."""
    messages = []

    async def send(message):
        messages.append(message)

    turn = LiveTurn(send)
    turn.offer(0, "a")
    await asyncio.sleep(0.01)  # the task writes the first event, with the role chunk, then lets events go direct
    assert len(bodies_of(messages)) == 1
    for seq, text in enumerate(["b", "c", "d"], start=1):
        turn.offer(seq, text)
        assert bodies_of(messages)[-1] == frame(ChunkWriter("r", "m", True, CREATED).delta(text, None))
    assert len(bodies_of(messages)) == 4
    turn.offer(4, final=True)  # the final event is the task's: it runs the turn's hooks
    await turn.task
    assert b"".join(bodies_of(messages)) == await stream_bytes(StreamFormat(), ["a", "b", "c", "d"])


async def test_a_write_that_has_to_wait_keeps_every_frame_once_and_in_order():
    """A full socket: the write of ``c`` waits. It is finished by a task; what arrives meanwhile goes
    to the stream's task, which writes it only after ``c`` is out."""
    messages, socket_full = [], asyncio.Event()

    async def send(message):
        if b'"c"' in message.get("body", b""):
            await socket_full.wait()
        messages.append(message)

    turn = LiveTurn(send)
    turn.offer(0, "a")
    await asyncio.sleep(0.01)
    turn.offer(1, "b")
    turn.offer(2, "c")  # starts writing, then waits
    turn.offer(3, "d")
    turn.offer(4, "e")
    await asyncio.sleep(0.01)
    assert b'"d"' not in b"".join(bodies_of(messages))  # queued behind c
    socket_full.set()
    turn.offer(5, final=True)
    await turn.task
    assert naive_parse(b"".join(bodies_of(messages))) == naive_parse(
        await stream_bytes(StreamFormat(), ["a", "b", "c", "d", "e"]))


async def test_a_direct_write_that_fails_ends_the_stream_in_its_task_not_in_the_router():
    messages = []

    async def send(message):
        if b'"b"' in message.get("body", b""):
            raise RuntimeError("the server refused the write")
        messages.append(message)

    turn = LiveTurn(send)
    turn.offer(0, "a")
    await asyncio.sleep(0.01)
    turn.offer(1, "b")  # the router's call returns: the failure is not its own
    with pytest.raises(RuntimeError, match="refused the write"):
        await turn.task


@pytest.mark.parametrize(("error", "status", "code"), [
    ("invalid_request: log probabilities are not served by the hf engine's manager batching", 400, "invalid_request"),
    ("engine step failed: out of memory", 500, "generation_failed"),
])
def test_a_request_the_engine_refused_as_asked_is_a_bad_request_and_a_failure_a_server_error(error, status, code):
    """The GPU consumer answers a request no engine can serve as asked with ``invalid_request: why``
    (gpu_consumers/refusals.py, sequence.py): the client asked for it, so it is theirs to change."""
    raised = generation_error(TokenEvent("r", 3, finish_reason="error", error=error))
    assert raised is not None and (raised.status, raised.body()["error"]["code"]) == (status, code)
    assert error.removeprefix("invalid_request: ") in raised.body()["error"]["message"]


def test_a_chunk_s_scores_rendered_as_text_are_json_s_rendering_of_openai_s_shape():
    """The streamed chunk's log probabilities are rendered by hand (the hot path); they must be
    what json writes for the shape the whole completion carries, quotes, newlines, accents and all."""
    scored = [TokenLogprob(' na\u00efve"\n', -0.31, [TopLogprob(" a", -1e-9), TopLogprob("\u00e9\\", -math.inf)]),
              TokenLogprob("\ufffd", 0.0)]
    assert chat_logprobs_json(scored) == json.dumps(chat_logprobs(scored), separators=(",", ":"), ensure_ascii=False)
    assert chat_logprobs_json(scored) == chat_logprobs_json(scored)  # and again, from the cache


def test_a_token_the_logits_rule_out_is_shown_at_openai_s_floor_in_strict_json():
    """-inf (a banned token, an end token held off) is not JSON: both shapes, streamed and whole,
    show it as OpenAI and vLLM do, -9999.0, and a strict parser (a browser's) reads every one."""
    scored = [TokenLogprob(" a", -0.5, [TopLogprob(" a", -0.5), TopLogprob(" b", -math.inf)]),
              TokenLogprob(" c", -math.inf)]
    strict = {"parse_constant": lambda name: pytest.fail(f"{name} is not JSON")}
    streamed = json.loads(chat_logprobs_json(scored), **strict)
    assert [[a["logprob"] for a in t["top_logprobs"]] for t in streamed["content"]] == [[-0.5, -9999.0], []]
    assert [t["logprob"] for t in streamed["content"]] == [-0.5, -9999.0]
    assert json.loads(json.dumps(chat_logprobs(scored)), **strict) == streamed
    legacy = json.loads(json.dumps(TextLogprobs().of(scored)), **strict)
    assert legacy["token_logprobs"] == [-0.5, -9999.0] and legacy["top_logprobs"][0] == {" a": -0.5, " b": -9999.0}
