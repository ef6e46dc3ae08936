"""The codec scenario (bench/codec.py): every way it times writes the same bytes and reads back
the same record, and it refuses to time ways that do not."""

import pytest

from bench.codec import WAYS, Ways, records, run
from tokenbus.schemas import AvroCodec


def test_each_record_is_timed_each_way_after_the_ways_agree():
    result = run(calls=20, rounds=1)
    assert [row["record"] for row in result["rows"]] == list(records())
    for row in result["rows"]:
        assert row["bytes"] > 10
        assert all(row[f"{op}_{way}_us"] > 0 for op in ("encode", "decode") for way in WAYS)


def test_a_way_that_writes_other_bytes_is_refused():
    record = records()["request, one message"]
    ways = Ways(AvroCodec(), record)
    encode = ways.encode["dicts"]
    ways.encode["dicts"] = lambda r: encode(r) + b"\x00"
    with pytest.raises(AssertionError, match="different bytes"):
        ways.check(record)
