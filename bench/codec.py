"""What a record costs to write and to read on the bus, by type: a token event (a GPU consumer
writes one for every token of every sequence, an edge and output moderation read each), a request
(an edge writes one, a GPU consumer reads it) and a completion (a GPU consumer writes one a turn,
the stream processors read it).

Four ways, each the whole of ``AvroCodec.encode`` / ``decode``'s work for one record (framing,
the fingerprint, the body): as tokenbus does it (the compiled writer reading the object's
attributes, the compiled reader building the objects), the same in Confluent's wire format (as with
a schema registry, its ids already known, as they are once a service has started: here from a
stand-in that numbers the schemas, for no registry is asked for anything while records flow), the
same compiled code through the dicts ``to_avro`` and ``from_avro`` make, and fastavro's schemaless
writer and reader with those dicts.
Rounds alternate and the best of each counts (these machines are noisy); every way's bytes and
records are checked equal before anything is timed."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from typing import Any

import fastavro

from tokenbus.schemas import AvroCodec, ChatMessage, ChatRequest, Completion, Record, TokenEvent, ToolSpec
from tokenbus.schemas.avro_reader import compile_reader
from tokenbus.schemas.avro_writer import compile_writer
from tokenbus.schemas.codec import CONFLUENT_HEADER_SIZE, HEADER_SIZE, SINGLE_OBJECT_MAGIC, schema_fingerprint

ROUNDS = 5
CALLS = 5_000
WAYS = ("served", "confluent", "dicts", "fastavro")
WEATHER = ToolSpec("get_weather", "The weather in a city, now.",
                   '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}')


def records() -> dict[str, Record]:
    """One of each, shaped as on the bus: a token event mid-stream and a final one, a one-message
    request and a conversation's next turn offering a function, that turn's completion."""
    turn = [ChatMessage("system", "You are a concise assistant for a logistics company."),
            *(ChatMessage("user" if i % 2 == 0 else "assistant", f"Message {i} of the conversation, a sentence long.")
              for i in range(6)),
            ChatMessage("user", "And what is the weather in Kraków where the next shipment lands?")]
    conversation = ChatRequest("chatcmpl-4f9c2a7be1d04c35", "tokenbus-sim", "standard", turn, "tokens", 3,
                               tenant="acme", key_id="key-7", conversation_id="conv-12", max_tokens=256,
                               temperature=0.7, tools=[WEATHER], created_at_ms=1_795_000_000_123)
    return {
        "token event": TokenEvent("chatcmpl-4f9c2a7be1d04c35", 41, " shipment", [53_112], worker_id="gpu-0",
                                  created_at_ms=1_795_000_000_456),
        "final token event": TokenEvent("chatcmpl-4f9c2a7be1d04c35", 128, ".", [13], finish_reason="stop",
                                        prompt_tokens=412, completion_tokens=128, cached_tokens=384,
                                        worker_id="gpu-0", created_at_ms=1_795_000_001_789),
        "request, one message": ChatRequest("chatcmpl-0b3e8d21c6a94f70", "tokenbus-sim", "standard",
                                            [ChatMessage("user", "Summarise the delivery terms in two sentences.")],
                                            "tokens", 3, tenant="acme", key_id="key-7", max_tokens=128,
                                            created_at_ms=1_795_000_000_001),
        "request, a conversation's turn": conversation,
        "completion of that turn": Completion.for_request(
            conversation, text="It is 14 °C and cloudy in Kraków. " * 8, finish_reason="stop", prompt_tokens=412,
            completion_tokens=128, cached_prompt_tokens=384, worker_id="gpu-0", started_at_ms=1_795_000_000_200,
            first_token_at_ms=1_795_000_000_260, finished_at_ms=1_795_000_001_789),
    }


class NumberedSchemas:
    """A schema registry's ids, as a codec knows them once its service has started (``id_of``
    answered at its start); ``schema`` is never asked while the ids are known."""

    url = "(numbered in process)"

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def id_of(self, subject: str, schema: dict[str, Any]) -> int:
        return self._ids.setdefault(subject, len(self._ids) + 1)

    def schema(self, schema_id: int) -> dict[str, Any] | None:
        raise AssertionError("a registry asked for a schema while records flow")


class Ways:
    """Encode and decode of one record type, each way."""

    def __init__(self, codec: AvroCodec, record: Record, confluent: AvroCodec | None = None) -> None:
        kind = type(record)
        schema = codec.schema(record.schema_name)
        header = SINGLE_OBJECT_MAGIC + schema_fingerprint(schema)
        write_dict, read_dict = compile_writer(schema), compile_reader(schema)

        def dict_encode(r: Record) -> bytes:
            out = [header]
            write_dict(out, r.to_avro())
            return b"".join(out)

        def fastavro_encode(r: Record) -> bytes:
            out = io.BytesIO()
            out.write(header)
            fastavro.schemaless_writer(out, schema, r.to_avro())
            return out.getvalue()

        def fastavro_decode(data: bytes) -> Any:
            return kind.from_avro(fastavro.schemaless_reader(io.BytesIO(data[HEADER_SIZE:]), schema, None))

        confluent = confluent or confluent_codec()
        self.encode: dict[str, Callable[[Record], bytes]] = {
            "served": codec.encode, "confluent": confluent.encode, "dicts": dict_encode, "fastavro": fastavro_encode}
        self.decode: dict[str, Callable[[bytes], Any]] = {
            "served": lambda data: codec.decode(data, kind),
            "confluent": lambda data: confluent.decode(data, kind),
            "dicts": lambda data: kind.from_avro(read_dict(data, HEADER_SIZE)[0]),
            "fastavro": fastavro_decode}

    def check(self, record: Record) -> dict[str, bytes]:
        """What each way writes, after checking that the ways agree (the same body; Confluent's
        framing has its own header) and each reads back ``record``."""
        written = {way: encode(record) for way, encode in self.encode.items()}
        bodies = {data[CONFLUENT_HEADER_SIZE if way == "confluent" else HEADER_SIZE:] for way, data in written.items()}
        headers = {data[:HEADER_SIZE] for way, data in written.items() if way != "confluent"}
        if len(bodies) != 1 or len(headers) != 1:
            raise AssertionError(f"{record.schema_name}: the ways write different bytes")
        for way, decode in self.decode.items():
            if decode(written[way if way == "confluent" else "served"]) != record:
                raise AssertionError(f"{record.schema_name}: {way} reads back another record")
        return written


def confluent_codec() -> AvroCodec:
    codec = AvroCodec(registry=NumberedSchemas())  # type: ignore[arg-type]  # a registry's ids, known
    codec.register_schemas()
    return codec


def us_per_call(call: Callable[[Any], Any], argument: Any, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        call(argument)
    return (time.perf_counter() - started) / calls * 1e6


def run(calls: int = CALLS, rounds: int = ROUNDS) -> dict[str, Any]:
    codec, confluent = AvroCodec(), confluent_codec()
    cases = {label: (record, Ways(codec, record, confluent)) for label, record in records().items()}
    data = {label: ways.check(record) for label, (record, ways) in cases.items()}
    best: dict[tuple[str, str, str], float] = {}
    for _ in range(rounds):
        for label, (record, ways) in cases.items():
            for way in WAYS:
                written = data[label]["confluent" if way == "confluent" else "served"]
                for op, call, argument in (("encode", ways.encode[way], record), ("decode", ways.decode[way], written)):
                    key = (label, op, way)
                    best[key] = min(best.get(key, float("inf")), us_per_call(call, argument, calls))
    rows = [{"record": label, "bytes": len(data[label]["served"]),
             **{f"{op}_{way}_us": round(best[(label, op, way)], 2) for op in ("encode", "decode") for way in WAYS}}
            for label in cases]
    return {"scenario": "codec", "calls": calls, "rounds": rounds, "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = ["| record | bytes | encode: served / Confluent's framing / dicts / fastavro µs "
             "| decode: served / Confluent's framing / dicts / fastavro µs |",
             "|---|---:|---:|---:|"]
    for row in result["rows"]:
        encode = " / ".join(str(row[f"encode_{way}_us"]) for way in WAYS)
        decode = " / ".join(str(row[f"decode_{way}_us"]) for way in WAYS)
        lines.append(f"| {row['record']} | {row['bytes']} | {encode} | {decode} |")
    lines += ["", f"served: as the codec does it (compiled, from and into the objects); Confluent's framing: the same "
              f"with a schema registry's ids; dicts: the same compiled "
              f"code through `to_avro` / `from_avro`; fastavro: its schemaless writer and reader with those dicts. "
              f"Best of {result['rounds']} rounds of {result['calls']} calls."]
    return "\n".join(lines)
