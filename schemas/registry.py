"""A client of a schema registry that speaks Confluent's REST API (Confluent Schema Registry, and
the registries that implement its API: Karapace, Redpanda's, Apicurio's compatibility API): the ids
of the bus's schemas, for Confluent's wire format (codec.py), so that the ecosystem's readers
(ClickHouse's ``AvroConfluent``, Kafka Connect's ``AvroConverter``, ksqlDB) read the bus's topics.

A record type's subject is its full name (``tokenbus.TokenEvent``: Confluent's
``RecordNameStrategy``), since one type goes to several topics and a topic's records are of one
type. Calls are synchronous and each is made once per schema in a process: a service registers the
current schemas (or looks their ids up) as it starts, and a reader fetches the schema of an id it
has not met, once. That blocks the event loop for a round trip, as Confluent's own serializers do;
afterwards it is a dict lookup.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import httpx

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
# A reader whose record's schema the registry could not give (it did not answer) reads the record
# again after this long: the record is fine, and is neither skipped nor dead-lettered.
READ_AGAIN_AFTER_S = 1.0


class SchemaRegistryError(RuntimeError):
    """The registry could not be asked, or refused: ``status`` is its HTTP status (0 where none
    came), ``error_code`` its own code (e.g. 409 for a schema incompatible with the subject's)."""

    def __init__(self, message: str, status: int = 0, error_code: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.error_code = error_code


class SchemaRegistry:
    def __init__(self, url: str, auto_register: bool = True, timeout_s: float = 5.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        """``url``: the registry's base address (credentials in it are sent as basic auth);
        ``auto_register``: register a schema the subject lacks, or only look its id up (where
        schemas are registered by a deployment step and clients may not)."""
        self.url = url.rstrip("/")
        self.auto_register = auto_register
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, transport=transport,
                                  headers={"Accept": CONTENT_TYPE, "Content-Type": CONTENT_TYPE})

    def close(self) -> None:
        self._http.close()

    def id_of(self, subject: str, schema: dict[str, Any]) -> int:
        """The id of ``schema`` under ``subject``: registered there first unless the registry has
        it (with ``auto_register``), else looked up (a schema not registered is an error)."""
        path = f"/subjects/{quote(subject, safe='')}"
        answer = self._call("POST", f"{path}/versions" if self.auto_register else path,
                            {"schema": json.dumps(schema, separators=(",", ":"))})
        return int(answer["id"])

    def schema(self, schema_id: int) -> dict[str, Any] | None:
        """The Avro schema registered under ``schema_id``, or None where the registry has none."""
        try:
            answer = self._call("GET", f"/schemas/ids/{schema_id}")
        except SchemaRegistryError as exc:
            if exc.status == 404:
                return None
            raise
        kind = answer.get("schemaType", "AVRO")
        if kind != "AVRO":
            raise SchemaRegistryError(f"schema {schema_id} is {kind}, not Avro")
        parsed: dict[str, Any] = json.loads(answer["schema"])
        return parsed

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise SchemaRegistryError(f"schema registry {self.url} {method} {path}: {exc}") from exc
        try:
            answer = response.json()
        except ValueError:
            answer = {}
        if response.status_code >= 400:
            raise SchemaRegistryError(
                f"schema registry {self.url} {method} {path}: HTTP {response.status_code} "
                f"{answer.get('message', response.text[:200]) if isinstance(answer, dict) else ''}",
                response.status_code, answer.get("error_code", 0) if isinstance(answer, dict) else 0)
        if not isinstance(answer, dict):
            raise SchemaRegistryError(f"schema registry {self.url} {method} {path}: not a JSON object")
        return answer
