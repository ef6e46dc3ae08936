"""The worker's cache reports on the real broker: what a leaving worker tells routers."""

import asyncio

from aiokafka import TopicPartition

from tests.conftest import MODEL
from tests.gpu_consumers.helpers import read_all
from tokenbus.gpu_consumers.engines.simulated import PrefixCacheModel
from tokenbus.gpu_consumers.prefix_reports import PrefixReports
from tokenbus.schemas import AvroCodec, CacheReport
from tokenbus.topics import RecordSender, TopicCatalog, make_producer

codec = AvroCodec()


async def test_stopping_right_after_a_change_still_reports_leaving(bus):
    """A worker giving its partitions back marks the reports changed and stops them at once. On
    Python 3.11, ``asyncio.wait_for`` returned the event's result and swallowed the cancellation
    when both landed in one loop pass, so ``stop()`` waited for ever and the worker never left."""
    catalog = TopicCatalog(bus)
    producer = make_producer(bus)
    await producer.start()
    try:
        reports = PrefixReports(PrefixCacheModel(4096, 16), RecordSender(producer, codec, catalog), "w-leaving", MODEL,
                                lambda: (0, 0), report_interval_ms=10, snapshot_interval_s=60)
        reports.start()
        await asyncio.sleep(0.1)  # the first snapshot is out; the task waits for a change
        reports.owned({TopicPartition(catalog.requests(MODEL, "standard"), 0)})
        async with asyncio.timeout(10):
            await reports.stop()
    finally:
        await producer.stop()

    # The first snapshot, maybe the change's report (if it went out before the stop), then the leaving one.
    records = await read_all(bus, catalog.cache_reports,
                             until=lambda got: any(codec.decode(r.value, CacheReport).leaving for r in got))
    last = codec.decode(records[-1].value, CacheReport)
    assert last.worker_id == "w-leaving" and last.leaving and last.partitions == []
