"""The SDK's client (producers/client.py) against the real embedded broker: a request out of range
is refused before anything is sent, with the field named, so that its caller learns at once what a
GPU consumer would only dead-letter."""

from __future__ import annotations

import dataclasses

import pytest

from tests.stream_processors.helpers import read_topic
from tokenbus.producers import TokenbusClient
from tokenbus.schemas import ChatMessage, RequestOutOfRange
from tokenbus.topics import TopicCatalog

pytestmark = pytest.mark.stack


async def test_a_request_out_of_range_is_refused_before_it_is_sent(bus):
    topic = TopicCatalog(bus).requests(bus.models[0], "standard")
    async with TokenbusClient(bus) as client:
        request = client.new_request(bus.models[0], [ChatMessage("user", "Hello")], tier="standard")
        too_hot = dataclasses.replace(request, temperature=3.0)
        with pytest.raises(RequestOutOfRange, match=r"temperature 3.0 is not in \[0, 2\]"):
            await client.publish(too_hot)
        with pytest.raises(RequestOutOfRange, match="messages must not be empty"):
            await client.submit(dataclasses.replace(request, messages=[]))
        assert client.router.open_streams == 0, "no reply stream was left open"
        assert await client.publish(request) is not None
    assert [r.key.decode() for r in await read_topic(bus, topic)] == [request.request_id]
