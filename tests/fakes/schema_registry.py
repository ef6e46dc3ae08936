"""A stand-in for a schema registry with Confluent's REST API, for tests where none can run:
Confluent Schema Registry is a Java service and Karapace is not on PyPI, and neither ships in the
package registries the machines this suite runs on reach. It is a real HTTP server (on 127.0.0.1,
in a thread), so that the same client code and ClickHouse's ``AvroConfluent`` reader talk to it as
to a registry, and it is faithful to what they use of the API:

- ``POST /subjects/{subject}/versions`` registers a schema (``{"schema": "<json>"}``) and answers
  ``{"id": n}``; a schema already under the subject keeps its id and version, and one schema gets
  one id across subjects (ids compare the schema's parsing canonical form);
- ``POST /subjects/{subject}`` looks a schema up: its ``subject``, ``id``, ``version`` and
  ``schema``, or 404 with error code 40401 (no such subject) or 40403 (not under it);
- ``GET /schemas/ids/{id}`` answers ``{"schema": "<json>"}``, or 404 with error code 40403;
  ``GET /subjects`` and ``GET /subjects/{subject}/versions`` list what is registered;
- errors are ``{"error_code": ..., "message": ...}`` with the HTTP status Confluent's uses, and
  with ``credentials`` set a request without that basic auth gets 401.

``unavailable`` answers everything with 503, as a registry that lost its backend does. It checks
no compatibility between a subject's versions (a real registry does, BACKWARD by
default): ``refuse_next`` makes it answer the next registration as a registry that found the
schema incompatible would. The same tests of the client run against a real registry where
``TOKENBUS_SCHEMA_REGISTRY_URL`` names one (tests/schemas/test_registry.py).
"""

from __future__ import annotations

import base64
import http.server
import json
import re
import threading
from typing import Any
from urllib.parse import unquote

from fastavro.schema import parse_schema, to_parsing_canonical_form


class FakeSchemaRegistry:
    def __init__(self, credentials: tuple[str, str] | None = None) -> None:
        self.credentials = credentials
        self.unavailable = False  # answer every request 503, as a registry behind a balancer that lost it
        self.requests: list[tuple[str, str]] = []  # (method, path), in order
        self._ids: dict[str, int] = {}  # canonical form -> id
        self._schemas: dict[int, str] = {}  # id -> the schema as first registered
        self._subjects: dict[str, list[int]] = {}  # subject -> ids, by version
        self._refusal: tuple[int, int, str] | None = None
        self._lock = threading.Lock()
        registry = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                registry._handle(self, "GET")

            def do_POST(self) -> None:
                registry._handle(self, "POST")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeSchemaRegistry:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop answering: the address refuses connections from now on."""
        self._server.shutdown()
        self._server.server_close()

    def register(self, subject: str, schema: dict[str, Any]) -> int:
        """Register ``schema`` under ``subject`` as a client would (an older writer, say)."""
        return self._register(subject, json.dumps(schema))

    def refuse_next(self, status: int = 409, error_code: int = 409,
                    message: str = "Schema being registered is incompatible with an earlier schema") -> None:
        self._refusal = (status, error_code, message)

    def latest_id(self, subject: str) -> int:
        return self._subjects[subject][-1]

    def ids_asked_for(self) -> list[int]:
        return [int(path.rsplit("/", 1)[1]) for method, path in self.requests if path.startswith("/schemas/ids/")]

    def _register(self, subject: str, text: str) -> int:
        canonical = to_parsing_canonical_form(parse_schema(json.loads(text)))
        with self._lock:
            schema_id = self._ids.setdefault(canonical, len(self._ids) + 1)
            self._schemas.setdefault(schema_id, text)
            versions = self._subjects.setdefault(subject, [])
            if schema_id not in versions:
                versions.append(schema_id)
            return schema_id

    def _handle(self, request: http.server.BaseHTTPRequestHandler, method: str) -> None:
        path = request.path.split("?", 1)[0]
        self.requests.append((method, path))
        body: Any = None
        if method == "POST":
            body = json.loads(request.rfile.read(int(request.headers.get("Content-Length") or 0)) or b"null")
        status, answer = self._answer(method, path, body, request.headers.get("Authorization"))
        data = json.dumps(answer).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def _answer(self, method: str, path: str, body: Any, authorization: str | None) -> tuple[int, Any]:
        if self.unavailable:
            return 503, {"error_code": 50003, "message": "Error while forwarding the request to the leader"}
        if self.credentials is not None:
            expected = "Basic " + base64.b64encode(":".join(self.credentials).encode()).decode()
            if authorization != expected:
                return 401, {"error_code": 401, "message": "Unauthorized"}
        if method == "GET" and path == "/subjects":
            return 200, sorted(self._subjects)
        if method == "GET" and (found := re.fullmatch(r"/schemas/ids/(\d+)", path)):
            text = self._schemas.get(int(found[1]))
            if text is None:
                return 404, {"error_code": 40403, "message": "Schema not found"}
            return 200, {"schema": text}
        if found := re.fullmatch(r"/subjects/([^/]+)/versions", path):
            subject = unquote(found[1])
            if method == "GET":
                if subject not in self._subjects:
                    return 404, {"error_code": 40401, "message": f"Subject '{subject}' not found."}
                return 200, list(range(1, len(self._subjects[subject]) + 1))
            if self._refusal is not None:
                (status, code, message), self._refusal = self._refusal, None
                return status, {"error_code": code, "message": message}
            try:
                return 200, {"id": self._register(subject, body["schema"])}
            except Exception as exc:
                return 422, {"error_code": 42201, "message": f"Invalid schema: {exc}"}
        if method == "POST" and (found := re.fullmatch(r"/subjects/([^/]+)", path)):
            subject = unquote(found[1])
            if subject not in self._subjects:
                return 404, {"error_code": 40401, "message": f"Subject '{subject}' not found."}
            canonical = to_parsing_canonical_form(parse_schema(json.loads(body["schema"])))
            schema_id = self._ids.get(canonical)
            if schema_id not in self._subjects[subject]:
                return 404, {"error_code": 40403, "message": "Schema not found"}
            return 200, {"subject": subject, "id": schema_id, "version": self._subjects[subject].index(schema_id) + 1,
                         "schema": self._schemas[schema_id]}
        return 404, {"error_code": 404, "message": "HTTP 404 Not Found"}
