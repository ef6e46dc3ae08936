"""Which requests a GPU consumer refuses (gpu_consumers/refusals.py): the cluster metadata a reply
partition is checked against is refreshed on a miss.

Refused requests on the real broker are in test_intake.py. Here the worker's metadata is a stand-in:
a partition added to ``tokens`` while a worker runs cannot be made on either broker these tests
run (the embedded broker answers no version of CreatePartitions, and librdkafka's mock cluster
makes topics only through its C API), so ``known_partitions`` and ``refresh_metadata`` are
functions over a set, as aiokafka's ``ClusterMetadata.partitions_for_topic`` and
``force_metadata_update`` are over what the brokers last answered."""

from __future__ import annotations

from tests.conftest import MODEL
from tokenbus.gpu_consumers.refusals import NO_REPLY_LOG, Refusals
from tokenbus.schemas import ChatMessage, ChatRequest
from tokenbus.topics import BusSettings, TopicCatalog


class Metadata:
    """What a worker's client knows of ``tokens``' partitions, and what the cluster has."""

    def __init__(self, partitions: int) -> None:
        self.known = set(range(partitions))
        self.cluster = set(self.known)
        self.refreshes = 0

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return set(self.known)

    async def force_metadata_update(self) -> bool:
        self.refreshes += 1
        self.known = set(self.cluster)
        return True


def refusals(catalog: TopicCatalog, metadata: Metadata) -> Refusals:
    return Refusals(catalog, None, None, "w", metadata.partitions_for_topic,  # type: ignore[arg-type]
                    metadata.force_metadata_update, lambda request: 1, 100)


def request(catalog: TopicCatalog, reply_partition: int, name: str = "r", reply_topic: str | None = None) -> ChatRequest:
    return ChatRequest(name, MODEL, "standard", [ChatMessage("user", "hi")], reply_topic or catalog.tokens, reply_partition)


async def test_a_partition_added_to_tokens_is_served_after_one_refresh_of_the_metadata():
    catalog = TopicCatalog(BusSettings(models=[MODEL]))
    metadata = Metadata(4)
    refusing = refusals(catalog, metadata)
    assert await refusing.problem(request(catalog, 3), MODEL, "standard") is None
    assert metadata.refreshes == 0  # a partition it knows: no refresh
    metadata.cluster.add(4)  # added on the cluster; the worker's metadata does not know it yet
    assert refusing.route_problem(request(catalog, 4), MODEL, "standard") is not None
    assert await refusing.problem(request(catalog, 4), MODEL, "standard") is None
    assert metadata.refreshes == 1


async def test_a_partition_that_is_not_there_is_refused_and_refreshes_at_most_once_a_second():
    catalog = TopicCatalog(BusSettings(models=[MODEL]))
    metadata = Metadata(4)
    refusing = refusals(catalog, metadata)
    for i in range(5):  # a burst of requests to a partition nobody added
        reason, detail = await refusing.problem(request(catalog, 9, f"r{i}"), MODEL, "standard")
        assert (reason, detail) == (NO_REPLY_LOG, f"reply_partition 9 is not a partition of {catalog.tokens}")
    assert metadata.refreshes == 1
    assert await refusing.problem(request(catalog, -1), MODEL, "standard") is not None
    assert await refusing.problem(request(catalog, 0, reply_topic=catalog.control), MODEL, "standard") is not None
    assert metadata.refreshes == 1  # neither a negative partition nor another topic asks the cluster
