"""Create missing topics with their intended partition counts (the broker would auto-create with 4)."""

from __future__ import annotations

import logging

from aiokafka import errors
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from tokenbus.topics.catalog import TopicSpec

log = logging.getLogger(__name__)

TOPIC_EXISTS = errors.TopicAlreadyExistsError.errno  # another provisioner got there first: fine


class TopicProvisioningError(RuntimeError):
    """The broker refused to create a topic of the catalog."""


async def ensure_topics(bootstrap_servers: str, specs: list[TopicSpec]) -> list[str]:
    """Create each topic in ``specs`` that does not exist yet; returns the names created."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [spec for spec in specs if spec.name not in existing]
        if wanted:
            response = await admin.create_topics(
                [NewTopic(spec.name, num_partitions=spec.partitions, replication_factor=spec.replicas,
                          topic_configs=spec.config) for spec in wanted]
            )
            # A refused topic (three replicas asked of a one-broker cluster, a config the broker
            # rejects) is an error, not a topic the broker would auto-create later with 1 replica.
            refused = [f"{name}: {errors.for_code(code).__name__}{f' ({rest[0]})' if rest and rest[0] else ''}"
                       for name, code, *rest in response.topic_errors if code not in (0, TOPIC_EXISTS)]
            if refused:
                raise TopicProvisioningError("the broker refused to create " + "; ".join(refused))
            log.info("created topics: %s", ", ".join(spec.name for spec in wanted))
        return [spec.name for spec in wanted]
    finally:
        await admin.close()


async def delete_topics(bootstrap_servers: str, names: list[str]) -> None:
    """The embedded broker has no retention: deleting a topic is how its memory comes back."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        await admin.delete_topics(names)
    finally:
        await admin.close()


class TopicAdmin:
    """A long-lived admin connection, for a process that creates and deletes topics as it runs
    (a reply router rolling its logs on the embedded broker)."""

    def __init__(self, bootstrap_servers: str) -> None:
        self._admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)

    async def start(self) -> None:
        await self._admin.start()

    async def close(self) -> None:
        await self._admin.close()

    async def create(self, name: str, partitions: int) -> None:
        response = await self._admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
        refused = [errors.for_code(code).__name__ for _, code, *_ in response.topic_errors if code not in (0, TOPIC_EXISTS)]
        if refused:
            raise TopicProvisioningError(f"the broker refused to create {name}: {refused[0]}")

    async def delete(self, names: list[str]) -> None:
        await self._admin.delete_topics(names)

    async def names(self) -> list[str]:
        return list(await self._admin.list_topics())
