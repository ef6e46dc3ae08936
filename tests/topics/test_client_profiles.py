"""The client profiles of topics/clients.py, counted from the client side against the real
embedded broker: an idle consumer with the Kafka profile sends a couple of fetches a second
(the broker is asked to hold each up to 500 ms), the embedded profile polls."""

import asyncio

from aiokafka import TopicPartition

from tokenbus.topics import BusSettings, TopicCatalog, make_consumer
from tokenbus.topics.clients import PROFILES

WINDOW_S = 3.0


async def fetches_while_idle(bus: BusSettings, background: bool = False) -> float:
    """Fetch requests per second of a consumer reading one partition nobody writes to."""
    consumer = make_consumer(bus, background=background)
    sent: list[str] = []
    send = consumer._client.send

    async def counting_send(node_id, request, *args, **kwargs):
        sent.append(type(request).__name__)
        return await send(node_id, request, *args, **kwargs)

    consumer._client.send = counting_send
    await consumer.start()
    try:
        tp = TopicPartition(TopicCatalog(bus).control, 0)
        consumer.assign([tp])
        consumer.seek(tp, 0)
        await consumer.getmany(timeout_ms=500)  # warmed up: metadata and the first fetch are done
        before = sum(name.startswith("FetchRequest") for name in sent)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WINDOW_S
        while loop.time() < deadline:
            await consumer.getmany(timeout_ms=100)
        return (sum(name.startswith("FetchRequest") for name in sent) - before) / WINDOW_S
    finally:
        await consumer.stop()


def test_the_default_profile_is_kafka():
    assert BusSettings().broker == "kafka"
    assert PROFILES["kafka"].fetch_max_wait_ms >= 500 > PROFILES["embedded"].fetch_max_wait_ms


async def test_an_idle_consumer_with_kafka_settings_fetches_a_few_times_a_second(bus):
    kafka = await fetches_while_idle(bus.model_copy(update={"broker": "kafka"}))
    embedded = await fetches_while_idle(bus.model_copy(update={"broker": "embedded"}))
    # The broker holds a fetch for at most its wait (here about half of it): at most ~4 a second.
    print(f"idle fetches per second: kafka {kafka:.1f}, embedded {embedded:.1f}")
    assert 0 < kafka <= 5, kafka
    assert embedded > 10 * kafka, (embedded, kafka)  # the embedded profile buys latency with polling
