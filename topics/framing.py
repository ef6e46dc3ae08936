"""How records are framed on this bus: Avro single-object encoding, or Confluent's wire format
where a schema registry is configured (``BusSettings.schema_registry_url``). Every service makes
its codec here, so that all of a bus's services frame alike."""

from __future__ import annotations

from tokenbus.schemas import AvroCodec
from tokenbus.schemas.registry import SchemaRegistry
from tokenbus.topics.settings import BusSettings


def make_codec(settings: BusSettings) -> AvroCodec:
    """The codec for ``settings``' bus. With a registry, the current schemas' ids are asked for
    first (registered where the registry lacks them): a service that cannot reach its registry
    fails as it starts (``SchemaRegistryError``), not at its first record."""
    if settings.schema_registry_url is None:
        return AvroCodec()
    codec = AvroCodec(registry=SchemaRegistry(settings.schema_registry_url, settings.schema_registry_auto_register))
    codec.register_schemas()
    return codec
