"""The OpenAPI description of the edge, built from the same pydantic models that validate requests."""

from __future__ import annotations

from typing import Any

from tokenbus.sse_edge.protocol.batches import CreateBatchRequest
from tokenbus.sse_edge.protocol.chat import ChatCompletionRequest, ContinueRequest
from tokenbus.sse_edge.protocol.compaction import CompactRequest
from tokenbus.sse_edge.protocol.completions import CompletionRequest
from tokenbus.sse_edge.protocol.conversations import (
    AddItemsRequest,
    CreateConversationRequest,
    UpdateConversationRequest,
)
from tokenbus.sse_edge.protocol.keys import CreateKeyRequest
from tokenbus.sse_edge.protocol.moderations import ModerationRequest
from tokenbus.sse_edge.protocol.responses import InputTokensRequest, ResponsesRequest
from tokenbus.sse_edge.protocol.stored_completions import UpdateCompletionRequest

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {
        "type": "integer", "description": "Prompt tokens served from the engine's prefix cache (billed at the cached rate)."}}}}}


def completion_schema(kind: str, answer: str) -> dict[str, Any]:
    """A whole (not streamed) response: ``chat.completion`` choices hold a ``message``,
    ``text_completion`` choices a ``text``."""
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": kind}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": USAGE,
            "choices": {"type": "array", "items": {"type": "object", "required": ["index", answer, "finish_reason"]}},
        },
    }


CHAT_COMPLETION = completion_schema("chat.completion", "message")
# A stored one: as answered, with its metadata (which its client may change).
STORED_COMPLETION = {**CHAT_COMPLETION, "properties": {
    **CHAT_COMPLETION["properties"], "metadata": {"type": "object", "additionalProperties": {"type": "string"}}}}
TEXT_COMPLETION = completion_schema("text_completion", "text")
API_KEY = {"type": "object", "required": ["id", "object", "tenant", "tier", "models", "admin", "revoked"], "properties": {
    "id": {"type": "string"}, "object": {"const": "api_key"}, "tenant": {"type": "string"}, "tier": {"type": "string"},
    "models": {"type": "array", "items": {"type": "string"}}, "rpm": {"type": "integer"}, "tpm": {"type": "integer"},
    "fallback": {"type": "boolean"}, "admin": {"type": "boolean"}, "created_at": {"type": "integer"},
    "revoked": {"type": "boolean"}}}
MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
    "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
    "owned_by": {"type": "string"}}}
MODEL_LIST = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "items": MODEL}}}

NULLABLE_ID = {"type": ["string", "null"]}
NULLABLE_TIME = {"type": ["integer", "null"]}
FILE = {"type": "object", "required": ["id", "object", "bytes", "created_at", "filename", "purpose"], "properties": {
    "id": {"type": "string"}, "object": {"const": "file"}, "bytes": {"type": "integer"},
    "created_at": {"type": "integer"}, "expires_at": NULLABLE_TIME, "filename": {"type": "string"},
    "purpose": {"enum": ["batch", "batch_output"]}}}
BATCH = {"type": "object", "required": ["id", "object", "endpoint", "input_file_id", "completion_window", "status",
                                        "created_at", "request_counts"], "properties": {
    "id": {"type": "string"}, "object": {"const": "batch"}, "endpoint": {"type": "string"},
    "errors": {"type": ["object", "null"]}, "input_file_id": {"type": "string"},
    "completion_window": {"type": "string"},
    "status": {"enum": ["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                        "cancelled"]},
    "output_file_id": NULLABLE_ID, "error_file_id": NULLABLE_ID, "created_at": {"type": "integer"},
    **{f"{at}_at": NULLABLE_TIME for at in ("in_progress", "expires", "finalizing", "completed", "failed", "expired",
                                            "cancelling", "cancelled")},
    "request_counts": {"type": "object", "required": ["total", "completed", "failed"], "properties": {
        "total": {"type": "integer"}, "completed": {"type": "integer"}, "failed": {"type": "integer"}}},
    "metadata": {"type": ["object", "null"]}, "model": NULLABLE_ID,
    "usage": {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"], "properties": {
        "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}}}}

MODERATION = {"type": "object", "required": ["id", "model", "results"], "properties": {
    "id": {"type": "string"}, "model": {"type": "string"}, "results": {"type": "array", "items": {
        "type": "object", "required": ["flagged", "categories", "category_scores", "action"], "properties": {
            "flagged": {"type": "boolean"}, "action": {"enum": ["allow", "flag", "redact", "block"]},
            "categories": {"type": "object", "additionalProperties": {"type": "boolean"}},
            "category_scores": {"type": "object", "additionalProperties": {"type": "number"}}}}}}}

RESPONSE = {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"], "properties": {
    "id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
    "status": {"enum": ["completed", "incomplete", "failed", "cancelled", "in_progress"]},
    "model": {"type": "string"}, "output": {"type": "array", "items": {"type": "object", "required": ["type", "id"]}},
    "previous_response_id": NULLABLE_ID, "error": {"type": ["object", "null"]},
    "incomplete_details": {"type": ["object", "null"]},
    "usage": {"type": ["object", "null"], "properties": {
        "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}}}}


CONVERSATION = {"type": "object", "required": ["id", "object", "created_at", "metadata"], "properties": {
    "id": {"type": "string"}, "object": {"const": "conversation"}, "created_at": {"type": "integer"},
    "metadata": {"type": "object", "additionalProperties": {"type": "string"}}}}
COMPACTED = {"type": "object", "required": ["id", "object", "created_at", "output", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"const": "response.compaction"}, "created_at": {"type": "integer"},
    "output": {"type": "array", "items": {"type": "object"}}, "usage": {"type": "object"}}}
INPUT_TOKENS = {"type": "object", "required": ["object", "input_tokens"], "properties": {
    "object": {"const": "response.input_tokens"}, "input_tokens": {"type": "integer", "minimum": 0}}}
ITEM = {"type": "object", "required": ["id", "type"], "properties": {"id": {"type": "string"}, "type": {"type": "string"}}}


def _list_of(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["object", "data", "has_more"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": item}, "has_more": {"type": "boolean"},
        "first_id": NULLABLE_ID, "last_id": NULLABLE_ID}}


def _page_parameters(max_limit: int) -> list[dict[str, Any]]:
    return [{"name": "limit", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1, "maximum": max_limit}},
            {"name": "after", "in": "query", "required": False, "description": "The last id of the page before",
             "schema": {"type": "string"}}]


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _body(schema: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}


def _path_id(name: str) -> list[dict[str, Any]]:
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]


def _errors(*codes: int) -> dict[str, Any]:
    error_body = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(code): {"description": "error", "content": error_body}
            for code in codes}


def _generation(operation: str, request_schema: str, response: dict[str, Any], secured: list[dict[str, list[str]]],
                answered: str) -> dict[str, Any]:
    """A chat or text completion's POST: its body, an Idempotency-Key, a body or an SSE stream back."""
    return {
        "operationId": operation, "security": secured,
        "parameters": [{"name": "Idempotency-Key", "in": "header", "required": False,
                        "schema": {"type": "string", "maxLength": 255}}],
        "requestBody": _body(request_schema),
        "responses": {"200": {"description": answered, "content": {"application/json": {"schema": response},
                                                                   "text/event-stream": {"schema": {"type": "string"}}}},
                      **_errors(400, 401, 403, 404, 408, 409, 413, 429, 503)},
    }


def openapi_spec() -> dict[str, Any]:
    request_schema = ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    text_schema = CompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    continue_schema = ContinueRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    create_key_schema = CreateKeyRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    create_batch_schema = CreateBatchRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    moderation_schema = ModerationRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    responses_schema = ResponsesRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    compact_schema = CompactRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    count_schema = InputTokensRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    conversation_schemas = {model.__name__: model.model_json_schema(ref_template="#/components/schemas/{model}")
                            for model in (CreateConversationRequest, UpdateConversationRequest, AddItemsRequest)}
    components = {"Error": ERROR, "ChatCompletionRequest": request_schema, **request_schema.pop("$defs", {}),
                  "CompletionRequest": text_schema, **text_schema.pop("$defs", {}),
                  "ContinueRequest": continue_schema, **continue_schema.pop("$defs", {}),
                  "CreateKeyRequest": create_key_schema, "ApiKey": API_KEY,
                  "CreateBatchRequest": create_batch_schema, "File": FILE, "Batch": BATCH,
                  "ModerationRequest": moderation_schema, **moderation_schema.pop("$defs", {}),
                  "ResponsesRequest": responses_schema, **responses_schema.pop("$defs", {}),
                  "CompactRequest": compact_schema, **compact_schema.pop("$defs", {}),
                  "InputTokensRequest": count_schema, **count_schema.pop("$defs", {}),
                  **conversation_schemas, "Conversation": CONVERSATION,
                  "UpdateCompletionRequest": UpdateCompletionRequest.model_json_schema(
                      ref_template="#/components/schemas/{model}")}
    secured: list[dict[str, list[str]]] = [{"bearer": []}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "tokenbus", "version": "0.1.0",
                 "description": "OpenAI-compatible chat (and text) completions served through a Kafka pipeline."},
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/chat/completions": {
                "post": _generation("createChatCompletion", "ChatCompletionRequest", CHAT_COMPLETION, secured,
                                    "A completion, or an SSE stream of chunks when stream is true"),
                "get": {"operationId": "listChatCompletions", "security": secured,
                        "description": "The completions asked with `store: true`, oldest first unless `order` is "
                                       "desc; of one `model`, and whose metadata holds every `metadata[key]=value`.",
                        "parameters": [*_page_parameters(100),
                                       {"name": "order", "in": "query", "required": False,
                                        "schema": {"enum": ["asc", "desc"]}},
                                       {"name": "model", "in": "query", "required": False, "schema": {"type": "string"}},
                                       {"name": "metadata", "in": "query", "required": False, "style": "deepObject",
                                        "schema": {"type": "object", "additionalProperties": {"type": "string"}}}],
                        "responses": {"200": _json("A page of stored completions", _list_of(STORED_COMPLETION)),
                                      **_errors(400, 401, 503)}},
            },
            "/v1/chat/completions/{completion_id}": {
                "get": {"operationId": "retrieveChatCompletion", "security": secured,
                        "parameters": _path_id("completion_id"),
                        "responses": {"200": _json("The stored completion", STORED_COMPLETION),
                                      **_errors(400, 401, 404, 503)}},
                "post": {"operationId": "updateChatCompletion", "security": secured,
                         "parameters": _path_id("completion_id"), "requestBody": _body("UpdateCompletionRequest"),
                         "responses": {"200": _json("The stored completion, its metadata replaced", STORED_COMPLETION),
                                       **_errors(400, 401, 404, 408, 413, 503)}},
                "delete": {"operationId": "deleteChatCompletion", "security": secured,
                           "parameters": _path_id("completion_id"),
                           "responses": {"200": _json("Deleted (object: chat.completion.deleted)", {"type": "object"}),
                                         **_errors(400, 401, 404, 503)}},
            },
            "/v1/chat/completions/{completion_id}/messages": {"get": {
                "operationId": "listChatCompletionMessages", "security": secured,
                "parameters": [*_path_id("completion_id"), *_page_parameters(100),
                               {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"]}}],
                "responses": {"200": _json("The messages the completion was asked with", _list_of({"type": "object"})),
                              **_errors(400, 401, 404, 503)}}},
            "/v1/completions": {"post": {
                **_generation("createCompletion", "CompletionRequest", TEXT_COMPLETION, secured,
                              "A text_completion, or an SSE stream of them when stream is true"),
                "description": "A text completion (OpenAI's legacy API): a prompt, continued as it is, with no "
                               "chat template, or a batch of prompts, n choices each. Its stream is read again, and "
                               "its turn continued, through the chat completion's routes, in these shapes.",
            }},
            "/v1/chat/completions/{completion_id}/stream": {"get": {
                "operationId": "resumeChatCompletionStream", "security": secured,
                "parameters": [
                    {"name": "completion_id", "in": "path", "required": True, "schema": {"type": "string"}},
                    {"name": "Last-Event-ID", "in": "header", "required": False,
                     "description": "The id of the last event received (SSE clients)",
                     "schema": {"type": "string", "pattern": "^[0-9]+-[0-9]+([.][0-9]+)?$"}},
                    {"name": "after_chunks", "in": "query", "required": False,
                     "description": "How many data chunks were received (clients of the data-only stream)",
                     "schema": {"type": "integer", "minimum": 0}}],
                "responses": {"200": {"description": "The rest of the SSE stream",
                                      "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                              **_errors(400, 401, 404)},
            }},
            "/v1/chat/completions/{completion_id}/continue": {"post": {
                "operationId": "continueChatCompletion", "security": secured,
                "description": "Generate the rest of a turn that ended incomplete; the transcript stores the "
                               "turn as one completed reply.",
                "parameters": [
                    {"name": "completion_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "requestBody": {"required": False, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ContinueRequest"}}}},
                "responses": {"200": {"description": "The continuation: a completion, or an SSE stream of chunks",
                                      "content": {"application/json": {"schema": CHAT_COMPLETION},
                                                  "text/event-stream": {"schema": {"type": "string"}}}},
                              **_errors(400, 401, 404, 409, 429, 503)},
            }},
            "/v1/chat/completions/{completion_id}/cancel": {"post": {
                "operationId": "cancelChatCompletion", "security": secured,
                "description": "Stop the generation now; a finished turn is left as it is.",
                "parameters": [
                    {"name": "completion_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "Cancelled (the stream ends with finish_reason 'cancelled')",
                                      "content": {"application/json": {"schema": {"type": "object"}}}},
                              **_errors(401, 404, 503)},
            }},
            "/v1/responses": {"post": {
                **_generation("createResponse", "ResponsesRequest", RESPONSE, secured,
                              "A response, or an SSE stream of its named events when stream is true"),
                "description": "OpenAI's Responses API: a turn, stored unless `store` is false, continued by a "
                               "later turn naming it as `previous_response_id`; with `background`, answered at once "
                               "and generated without the client. Function tools only; a repeat with the same "
                               "Idempotency-Key is answered with the stored response, or its stream read again.",
            }},
            "/v1/responses/compact": {"post": {
                "operationId": "compactResponse", "security": secured,
                "description": "OpenAI's compaction: the `input`, the chain `previous_response_id` ends, or both, "
                               "summarized by the model in one turn (billed as one), answered as every user message "
                               "then one `compaction` item, which a later turn's input takes in place of them.",
                "requestBody": _body("CompactRequest"),
                "responses": {"200": _json("The compacted response (object: response.compaction)", COMPACTED),
                              **_errors(400, 401, 403, 404, 408, 413, 429, 503)}}},
            "/v1/responses/input_tokens": {"post": {
                "operationId": "countInputTokens", "security": secured,
                "description": "The input tokens a Responses turn would be prompted with (instructions, input, "
                               "tools, the chain or conversation it continues), counted as the edge counts a prompt "
                               "against the context window; nothing is published.",
                "requestBody": _body("InputTokensRequest"),
                "responses": {"200": _json("The count (object: response.input_tokens)", INPUT_TOKENS),
                              **_errors(400, 401, 403, 404, 408, 413, 503)}}},
            "/v1/responses/{response_id}": {
                "get": {"operationId": "retrieveResponse", "security": secured,
                        "parameters": [*_path_id("response_id"),
                                       {"name": "stream", "in": "query", "required": False,
                                        "schema": {"type": "boolean"}},
                                       {"name": "starting_after", "in": "query", "required": False,
                                        "description": "The sequence number of the last event received",
                                        "schema": {"type": "integer", "minimum": -1}}],
                        "responses": {"200": {"description": "The stored response, or with stream its events again",
                                              "content": {"application/json": {"schema": RESPONSE},
                                                          "text/event-stream": {"schema": {"type": "string"}}}},
                                      **_errors(400, 401, 404, 503)}},
                "delete": {"operationId": "deleteResponse", "security": secured, "parameters": _path_id("response_id"),
                           "responses": {"200": _json("Deleted", {"type": "object"}), **_errors(401, 404, 503)}},
            },
            "/v1/responses/{response_id}/input_items": {"get": {
                "operationId": "listInputItems", "security": secured,
                "parameters": [*_path_id("response_id"), *_page_parameters(100),
                               {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"]}}],
                "responses": {"200": _json("The items the response was asked with", _list_of({"type": "object"})),
                              **_errors(400, 401, 404, 503)}}},
            "/v1/responses/{response_id}/cancel": {"post": {
                "operationId": "cancelResponse", "security": secured, "parameters": _path_id("response_id"),
                "description": "Stop a turn's generation now; a response that has ended is left as it is.",
                "responses": {"200": _json("The response as it ended", RESPONSE), **_errors(401, 404, 503)}}},
            "/v1/conversations": {"post": {
                "operationId": "createConversation", "security": secured,
                "description": "OpenAI's Conversations API: a conversation, with up to 20 items and metadata; a "
                               "Responses turn naming it is prompted with its items and adds its own once it ends.",
                "requestBody": _body("CreateConversationRequest"),
                "responses": {"200": _json("The conversation", CONVERSATION), **_errors(400, 401, 408, 413, 503)}}},
            "/v1/conversations/{conversation_id}": {
                "get": {"operationId": "retrieveConversation", "security": secured,
                        "parameters": _path_id("conversation_id"),
                        "responses": {"200": _json("The conversation", CONVERSATION), **_errors(400, 401, 404, 503)}},
                "post": {"operationId": "updateConversation", "security": secured,
                         "parameters": _path_id("conversation_id"), "requestBody": _body("UpdateConversationRequest"),
                         "responses": {"200": _json("The conversation, its metadata replaced", CONVERSATION),
                                       **_errors(400, 401, 404, 408, 413, 503)}},
                "delete": {"operationId": "deleteConversation", "security": secured,
                           "parameters": _path_id("conversation_id"),
                           "responses": {"200": _json("Deleted", {"type": "object"}), **_errors(400, 401, 404, 503)}},
            },
            "/v1/conversations/{conversation_id}/items": {
                "get": {"operationId": "listConversationItems", "security": secured,
                        "parameters": [*_path_id("conversation_id"), *_page_parameters(100),
                                       {"name": "order", "in": "query", "required": False,
                                        "schema": {"enum": ["asc", "desc"]}}],
                        "responses": {"200": _json("The conversation's items, newest first unless order=asc",
                                                   _list_of(ITEM)), **_errors(400, 401, 404, 503)}},
                "post": {"operationId": "createConversationItems", "security": secured,
                         "parameters": _path_id("conversation_id"), "requestBody": _body("AddItemsRequest"),
                         "responses": {"200": _json("The items added", _list_of(ITEM)),
                                       **_errors(400, 401, 404, 408, 413, 503)}},
            },
            "/v1/conversations/{conversation_id}/items/{item_id}": {
                "get": {"operationId": "retrieveConversationItem", "security": secured,
                        "parameters": [*_path_id("conversation_id"), *_path_id("item_id")],
                        "responses": {"200": _json("The item", ITEM), **_errors(400, 401, 404, 503)}},
                "delete": {"operationId": "deleteConversationItem", "security": secured,
                           "parameters": [*_path_id("conversation_id"), *_path_id("item_id")],
                           "responses": {"200": _json("The conversation, the item taken out", CONVERSATION),
                                         **_errors(400, 401, 404, 503)}},
            },
            "/v1/models": {"get": {"operationId": "listModels", "security": secured, "responses": {
                "200": {"description": "Models this key may use",
                        "content": {"application/json": {"schema": MODEL_LIST}}}, **_errors(401)}}},
            "/v1/models/{model}": {"get": {
                "operationId": "retrieveModel", "security": secured,
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "The model, if this key may use it",
                                      "content": {"application/json": {"schema": MODEL}}}, **_errors(401, 404)}}},
            "/v1/keys": {
                "get": {"operationId": "listKeys", "security": secured, "description": "A tenant admin key only",
                        "responses": {"200": {"description": "The tenant's keys, newest first (never their secrets)",
                                              "content": {"application/json": {"schema": {
                                                  "type": "object", "required": ["object", "data"], "properties": {
                                                      "data": {"type": "array", "items": {
                                                          "$ref": "#/components/schemas/ApiKey"}}}}}}},
                                      **_errors(401, 403)}},
                "post": {"operationId": "createKey", "security": secured, "description": "A tenant admin key only",
                         "requestBody": {"required": False, "content": {"application/json": {
                             "schema": {"$ref": "#/components/schemas/CreateKeyRequest"}}}},
                         "responses": {"201": {"description": "The new key, with its secret (shown this once)",
                                               "content": {"application/json": {"schema": {
                                                   "$ref": "#/components/schemas/ApiKey"}}}},
                                       **_errors(400, 401, 403, 404)}},
            },
            "/v1/keys/self": {"get": {"operationId": "ownKey", "security": secured, "responses": {
                "200": {"description": "The calling key, its limits and what is left of them this minute",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ApiKey"}}}},
                **_errors(401, 503)}}},
            "/v1/keys/{key_id}": {"delete": {
                "operationId": "revokeKey", "security": secured, "description": "A tenant admin key only",
                "parameters": [{"name": "key_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "Revoked"}, **_errors(401, 403, 404)}}},
            "/v1/moderations": {"post": {
                "operationId": "createModeration", "security": secured,
                "description": "Each text decided by the edge's moderation policy as a prompt on the key's tier: "
                               "the policy's categories, flagged unless the decision is `allow` (`action`).",
                "requestBody": _body("ModerationRequest"),
                "responses": {"200": _json("One result an input", MODERATION), **_errors(400, 401, 408, 413, 429)}}},
            "/v1/files": {
                "post": {"operationId": "createFile", "security": secured,
                         "description": "Upload a batch's input: JSON lines, each a request (custom_id, method, url, "
                                        "body). The only purpose is `batch`.",
                         "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
                             "type": "object", "required": ["file", "purpose"], "properties": {
                                 "file": {"type": "string", "format": "binary"},
                                 "purpose": {"type": "string", "enum": ["batch"]}}}}}},
                         "responses": {"200": _json("The file", FILE), **_errors(400, 401, 408, 413)}},
                "get": {"operationId": "listFiles", "security": secured,
                        "parameters": [*_page_parameters(10_000),
                                       {"name": "purpose", "in": "query", "required": False,
                                        "schema": {"type": "string"}},
                                       {"name": "order", "in": "query", "required": False,
                                        "schema": {"enum": ["asc", "desc"]}}],
                        "responses": {"200": _json("The tenant's files", _list_of(FILE)), **_errors(400, 401)}},
            },
            "/v1/files/{file_id}": {
                "get": {"operationId": "retrieveFile", "security": secured, "parameters": _path_id("file_id"),
                        "responses": {"200": _json("The file", FILE), **_errors(401, 404)}},
                "delete": {"operationId": "deleteFile", "security": secured, "parameters": _path_id("file_id"),
                           "responses": {"200": _json("Deleted", {"type": "object"}), **_errors(401, 404)}},
            },
            "/v1/files/{file_id}/content": {"get": {
                "operationId": "downloadFile", "security": secured, "parameters": _path_id("file_id"),
                "responses": {"200": {"description": "The file's bytes (a batch's output: JSON lines)",
                                      "content": {"application/jsonl": {"schema": {"type": "string"}},
                                                  "application/octet-stream": {"schema": {"type": "string"}}}},
                              **_errors(401, 404)}}},
            "/v1/batches": {
                "post": {"operationId": "createBatch", "security": secured,
                         "description": "Run an uploaded file's requests at the batch tier; a file with a bad line "
                                        "fails whole (status `failed`, its lines named in `errors`).",
                         "requestBody": _body("CreateBatchRequest"),
                         "responses": {"200": _json("The batch", BATCH), **_errors(400, 401, 404, 408, 413, 503)}},
                "get": {"operationId": "listBatches", "security": secured, "parameters": _page_parameters(100),
                        "responses": {"200": _json("The tenant's batches, newest first", _list_of(BATCH)),
                                      **_errors(400, 401)}},
            },
            "/v1/batches/{batch_id}": {"get": {
                "operationId": "retrieveBatch", "security": secured, "parameters": _path_id("batch_id"),
                "responses": {"200": _json("The batch", BATCH), **_errors(401, 404)}}},
            "/v1/batches/{batch_id}/cancel": {"post": {
                "operationId": "cancelBatch", "security": secured, "parameters": _path_id("batch_id"),
                "responses": {"200": _json("The batch, cancelling (or cancelled)", BATCH), **_errors(401, 404, 409)}}},
            "/healthz": {"get": {"operationId": "health", "responses": {"200": {"description": "alive"}}}},
            "/readyz": {"get": {"operationId": "ready", "responses": {"200": {"description": "ready"},
                                                                     "503": {"description": "not ready"}}}},
        },
    }
