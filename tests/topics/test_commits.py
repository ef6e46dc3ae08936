"""Offset commits of a group member (topics/clients.py ``commit_as_member``), on the embedded
broker and on a Kafka cluster: a member commits; a consumer whose membership is gone (the
coordinator no longer knew it: aiokafka resets its generation) sends nothing, since a commit
from outside the group is taken by a broker while the group is empty and, after the embedded
broker restarted, put offsets past the end of the re-created logs."""

import asyncio

from aiokafka import TopicPartition

from tests.conftest import MODEL
from tokenbus.topics import TopicCatalog, commit_as_member, make_consumer


async def test_a_member_commits_and_a_consumer_that_lost_its_membership_does_not(each_bus):
    topic = TopicCatalog(each_bus).requests(MODEL, "standard")
    group = f"{each_bus.topic_prefix}commits"
    consumer = make_consumer(each_bus, topic, group_id=group)
    await consumer.start()
    try:
        async with asyncio.timeout(30):
            while not consumer.assignment():
                await consumer.getmany(timeout_ms=100)
        tp = TopicPartition(topic, 0)
        assert tp in consumer.assignment()

        assert await commit_as_member(consumer, {tp: 2})
        assert await consumer.committed(tp) == 2

        consumer._coordinator.reset_generation()  # what aiokafka does when the coordinator does not know it
        assert not await commit_as_member(consumer, {tp: 5})
        assert await consumer.committed(tp) == 2
    finally:
        await consumer.stop()
